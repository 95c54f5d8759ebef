"""Pure math of one speculative round: logit processing, draft-tree construction, accept/reject
(greedy and lossless sampling) for chains and trees, and tau accounting.

Tensors in, tensors out; no model, no files. Randomness enters only as pre-drawn uniforms in
[0, 1) (``uniforms``), so a caller with one ``torch.Generator`` per row gets the same draws for a
row whatever batch it runs in.

Lossless sampling (temperature > 0), written ``p`` = target's processed distribution and ``q`` =
the distribution a draft was drawn from (letters as in Leviathan et al. 2023, Alg. 1):

* Chain: draft ``x_i ~ q_i`` (the drafter's processed distribution, zero outside a trimmed draft
  vocabulary). Accept with probability ``min(1, p_i(x_i) / q_i(x_i))``; at the first rejection
  sample from ``norm(max(0, p_i - q_i))``; if all k are accepted, sample the bonus from ``p_k``.
  Then ``P(out = y) = min(p, q)(y) + (1 - sum min(p, q)) * norm(max(0, p - q))(y) = p(y)``.
* Tree (EAGLE-2 dynamic tree, evaluate_posterior): the tree is a *deterministic* function of the
  drafter's output (top-k expansion, best ``total_tokens`` by cumulative log-probability), so each
  node's proposal distribution is the point mass ``q = delta_x`` and the drafts are exactly what it
  produced. At an accepted node with target distribution ``p`` and distinct children
  ``x_1..x_m`` (tried in sibling order): accept ``x_1`` with probability ``p(x_1)``; on rejection
  continue with ``p' = norm(max(0, p - delta_x1)) = p`` with ``x_1`` removed, renormalised; after the
  last sibling, sample from the remaining ``p'``. By induction on m,
  ``P(out = x_j) = prod_{i<j}(1 - p'_i(x_i)) p'_j(x_j) = p(x_j)`` and every other token keeps
  probability ``p(y)``: the committed token is distributed exactly as ``p`` (SpecInfer's multi-round
  rejection with point-mass proposals). Which children exist may depend on anything deterministic
  (scores, pruning); it never depends on the verifier's uniforms, so the argument holds at every
  node and, by the chain rule, for the whole committed sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


# ---- distributions ---------------------------------------------------------------------------
def process_logits(logits: Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> Tensor:
    """Temperature, top-k and nucleus (top-p) processing: the distribution sampling draws from.

    The order and tie rules are those of transformers' sampling warpers (``TemperatureLogitsWarper``,
    ``TopKLogitsWarper``, ``TopPLogitsWarper``, applied in that order), so the result is the
    distribution ``model.generate(do_sample=True, ...)`` samples from.

    Args:
        logits: [..., V] any float dtype.
        temperature: > 0.
        top_p: 0 < P <= 1; keeps the smallest highest-probability set whose mass reaches P
            (a token is kept when the mass strictly before it, in descending order, is < P),
            computed after top-k.
        top_k: 0 = off; else keep the logits >= the k-th largest (ties at the k-th value are
            all kept, as transformers does); k > V keeps everything.

    Returns:
        [..., V] float32 probabilities summing to 1 (zeros outside the kept set).

    Raises:
        ValueError: temperature <= 0, top_p outside (0, 1] or top_k < 0.
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: processing needs > 0 (0 means greedy)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p}: expected 0 < P <= 1")
    if top_k < 0:
        raise ValueError(f"top_k={top_k}: expected >= 0 (0 = off)")
    scaled = logits.float() / temperature
    if 0 < top_k < scaled.shape[-1]:
        kth = scaled.topk(top_k, dim=-1).values[..., -1:]  # [..., 1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs  # [..., V]
        keep = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, order, mass_before < top_p)
        probs = probs * keep
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_from_probs(probs: Tensor, uniforms: Tensor) -> Tensor:
    """Inverse-CDF sampling with given uniforms (never returns a zero-probability index).

    Args:
        probs: [..., V] non-negative weights (need not sum to 1), at least one positive per row.
        uniforms: [...] floats in [0, 1).

    Returns:
        [...] int64 indices. The CDF runs in float64.
    """
    cdf = probs.double().cumsum(-1)  # [..., V]
    x = (uniforms.double() * cdf[..., -1]).unsqueeze(-1)  # [..., 1]
    idx = torch.searchsorted(cdf, x, right=True).squeeze(-1)
    return idx.clamp_(max=probs.shape[-1] - 1)


def draw_uniforms(generators: Sequence[torch.Generator], n: int) -> Tensor:
    """``n`` float64 uniforms in [0, 1) per row, row b from ``generators[b]`` -> [B, n]."""
    return torch.stack([torch.rand(n, generator=g, dtype=torch.float64) for g in generators])


# ---- outcome of one round --------------------------------------------------------------------
@dataclass
class RoundOutcome:
    """What one verification decided, per row.

    Attributes:
        num_accepted: [B] int64, accepted draft tokens a (0 <= a <= depth).
        path: [B, D+1] int64 node indices root (0), then the accepted nodes; -1 after a.
            For a chain, node i is draft i (root = 0).
        bonus: [B] int64 target id sampled (or argmax) at the last accepted node.
    """

    num_accepted: Tensor
    path: Tensor
    bonus: Tensor

    def committed_tokens(self, node_tokens: Tensor) -> Tensor:
        """Tokens this round commits: accepted drafts then the bonus.

        Args:
            node_tokens: [B, T] target ids of the verified nodes (node 0 = root).

        Returns:
            [B, D+1] int64, row b holds ``num_accepted[b] + 1`` tokens then -1.
        """
        B, width = self.path.shape
        drafts = node_tokens.gather(1, self.path[:, 1:].clamp(min=0))  # [B, D]
        out = torch.cat([drafts, drafts.new_full((B, 1), -1)], dim=1)
        col = torch.arange(width, device=out.device)[None, :]
        out = torch.where(col < self.num_accepted[:, None], out, torch.full_like(out, -1))
        return out.scatter_(1, self.num_accepted[:, None], self.bonus[:, None])


def _chain_path(num_accepted: Tensor, k: int) -> Tensor:
    ar = torch.arange(k + 1, device=num_accepted.device)[None, :]  # [1, k+1]
    return torch.where(ar <= num_accepted[:, None], ar, torch.full_like(ar, -1))


# ---- chain ----------------------------------------------------------------------------------
def verify_chain_greedy(draft_ids: Tensor, target_logits: Tensor) -> RoundOutcome:
    """Greedy verification of a chain: accept while the draft equals the target's argmax.

    Args:
        draft_ids: [B, k] int64 target ids (k >= 0).
        target_logits: [B, k+1, V_t]; position i scores the token after root + drafts[:i].

    Returns:
        :class:`RoundOutcome`; the bonus is the target argmax after the last accepted draft.
    """
    k = draft_ids.shape[1]
    target_ids = target_logits.argmax(-1)  # [B, k+1]
    num_accepted = (draft_ids == target_ids[:, :k]).long().cumprod(-1).sum(-1)
    bonus = target_ids.gather(1, num_accepted[:, None]).squeeze(1)
    return RoundOutcome(num_accepted, _chain_path(num_accepted, k), bonus)


def verify_chain_sampling(
    draft_ids: Tensor, draft_probs: Tensor, target_probs: Tensor, uniforms: Tensor
) -> RoundOutcome:
    """Lossless speculative sampling for a chain (Leviathan et al. 2023, Alg. 1).

    Args:
        draft_ids: [B, k] int64 target ids, draft i sampled from ``draft_probs[:, i]``.
        draft_probs: [B, k, V_t] float32 q, zero outside a trimmed draft vocabulary.
        target_probs: [B, k+1, V_t] float32 p (processed: temperature, top-p).
        uniforms: [B, k+1] in [0, 1): k acceptance draws, then one for the final sample.

    Returns:
        :class:`RoundOutcome`; the bonus comes from ``norm(max(0, p_a - q_a))`` after a rejection at
        draft a, or from ``p_k`` when all k drafts are accepted.
    """
    B, k = draft_ids.shape
    V = target_probs.shape[-1]
    idx = draft_ids[..., None]
    p_x = target_probs[:, :k].gather(-1, idx).squeeze(-1)  # [B, k]
    q_x = draft_probs.gather(-1, idx).squeeze(-1)  # [B, k]
    accept = uniforms[:, :k] * q_x.double() < p_x.double()
    num_accepted = accept.long().cumprod(-1).sum(-1)
    residual = (target_probs[:, :k] - draft_probs).clamp_min(0)  # [B, k, V]
    final = torch.cat([residual, target_probs[:, k:]], dim=1)  # [B, k+1, V]
    at = num_accepted[:, None, None].expand(B, 1, V)
    final = final.gather(1, at).squeeze(1)  # [B, V]
    # A rejection with an all-zero residual has probability 0 (it needs p <= q everywhere, i.e.
    # p == q); float rounding can still reach it, and p is then the residual's limit.
    p_at = target_probs.gather(1, at).squeeze(1)
    final = torch.where(final.sum(-1, keepdim=True) > 0, final, p_at)
    bonus = sample_from_probs(final, uniforms[:, k])
    return RoundOutcome(num_accepted, _chain_path(num_accepted, k), bonus)


# ---- tree -----------------------------------------------------------------------------------
@dataclass
class DraftTree:
    """A draft tree per row, nodes in creation order (a parent precedes its children).

    Attributes:
        tokens: [B, T] int64 target ids, T = N + 1, node 0 = root (last committed token).
        parents: [B, T] int64 parent node index, -1 for the root.
        depths: [B, T] int64, 0 for the root.
        ancestors: [B, T, T] bool, ``ancestors[b, i, j]``: node j is node i or one of its ancestors
            (the tree attention mask among the T verified tokens).
        children: [B, T, K] int64 child node indices in sibling order (best drafter score first),
            -1 padded; K = top_k.
    """

    tokens: Tensor
    parents: Tensor
    depths: Tensor
    ancestors: Tensor
    children: Tensor

    @property
    def max_depth(self) -> int:
        """D, the deepest level any row may have (loop bound; rows may be shallower)."""
        return int(self.depths.max())


def build_tree(
    root_tokens: Tensor,
    cand_tokens: Tensor,
    cand_scores: Tensor,
    cand_parents: Tensor,
    cand_depths: Tensor,
    total_tokens: int,
    top_k: int,
) -> DraftTree:
    """Keep the ``total_tokens`` best candidates by cumulative log-probability (EAGLE-2).

    Args:
        root_tokens: [B] int64.
        cand_tokens: [B, C] int64 target ids of every drafted candidate, in creation order
            (depth 1 first).
        cand_scores: [B, C] float cumulative log-probabilities (each <= its parent's).
        cand_parents: [B, C] int64 candidate index of the parent, -1 for children of the root.
        cand_depths: [C] int64 depth of each candidate (>= 1).
        total_tokens: N <= C, nodes kept besides the root.
        top_k: K, the most children any candidate has.

    Returns:
        :class:`DraftTree` with T = N + 1. Ties in score keep the earlier (shallower) candidate, so
        a kept node's parent is always kept (scores never increase along a path).

    Raises:
        ValueError: N > C.
    """
    B, C = cand_tokens.shape
    dev = cand_tokens.device
    N = total_tokens
    if N > C:
        raise ValueError(f"total_tokens={N} exceeds the {C} drafted candidates")
    order = torch.sort(-cand_scores, dim=-1, stable=True).indices  # ties: creation order
    sel = order[:, :N].sort(-1).values  # [B, N] creation order: parents first
    node_of = torch.full((B, C), -1, dtype=torch.long, device=dev)
    node_of.scatter_(1, sel, torch.arange(1, N + 1, device=dev).expand(B, N))
    par_c = cand_parents.gather(1, sel)  # [B, N]
    par = torch.where(par_c < 0, torch.zeros_like(par_c), node_of.gather(1, par_c.clamp(min=0)))
    assert bool((par >= 0).all()), "tree selection lost a parent"
    parents = torch.cat([torch.full((B, 1), -1, dtype=torch.long, device=dev), par], dim=1)  # [B, T]
    tokens = torch.cat([root_tokens[:, None], cand_tokens.gather(1, sel)], dim=1)
    depths = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=dev), cand_depths[sel]], dim=1)
    return tree_from_parents(tokens, parents, depths, top_k)


def tree_from_parents(tokens: Tensor, parents: Tensor, depths: Tensor, width: int) -> DraftTree:
    """Complete a :class:`DraftTree` (ancestor mask, children table) from its nodes and parents.

    Args:
        tokens: [B, T] int64 target ids, node 0 = root.
        parents: [B, T] int64, -1 for the root; every parent precedes its child. A node whose parent
            is itself is padding (rows of a batch with fewer nodes): no path reaches it, it has no
            children and it sees only the prefix and itself.
        depths: [B, T] int64, 0 for the root.
        width: K, the children slots per node (at least the most siblings any node has).

    Returns:
        :class:`DraftTree`; children in node order.

    Raises:
        ValueError: a node has more than ``width`` children.
    """
    B, T = tokens.shape
    dev = tokens.device
    up = parents.clamp(min=0)  # root points at itself
    ancestors = torch.eye(T, dtype=torch.bool, device=dev).expand(B, T, T).clone()
    for _ in range(int(depths.max())):
        ancestors |= ancestors.gather(1, up[:, :, None].expand(B, T, T))
    pad = parents == torch.arange(T, device=dev)[None, :]  # [B, T]
    # Sibling rank = number of earlier nodes with the same parent.
    same = (parents[:, :, None] == parents[:, None, :]) & torch.ones(T, T, dtype=torch.bool, device=dev).tril(
        -1
    )
    rank = same.sum(-1)  # [B, T]
    most = int(rank[:, 1:].max()) + 1 if T > 1 else 0  # the most children of any node
    if most > width:
        raise ValueError(f"a draft-tree node has {most} children, more than width={width}")
    children = torch.full((B, (T + 1) * width), -1, dtype=torch.long, device=dev)
    flat = torch.where(pad, T * width, up * width + rank)[:, 1:]  # padding goes to a spare row
    children.scatter_(1, flat, torch.arange(1, T, device=dev).expand(B, T - 1))
    return DraftTree(tokens, parents, depths, ancestors, children.view(B, T + 1, width)[:, :T])


def verify_tree_greedy(tree: DraftTree, target_logits: Tensor) -> RoundOutcome:
    """Greedy verification of a tree: follow the child equal to the target's argmax.

    Args:
        tree: the verified tree (siblings have distinct tokens).
        target_logits: [B, T, V_t]; node i's row scores the token after node i.

    Returns:
        :class:`RoundOutcome` with the accepted root-to-node path.
    """
    B, T = tree.tokens.shape
    dev = tree.tokens.device
    D = tree.max_depth
    target_ids = target_logits.argmax(-1)  # [B, T]
    cur = torch.zeros(B, dtype=torch.long, device=dev)
    alive = torch.ones(B, dtype=torch.bool, device=dev)
    path = torch.full((B, D + 1), -1, dtype=torch.long, device=dev)
    path[:, 0] = 0
    for level in range(1, D + 1):
        want = target_ids.gather(1, cur[:, None])  # [B, 1]
        match = (tree.parents == cur[:, None]) & (tree.tokens == want)  # [B, T]
        hit = match.any(-1) & alive
        child = match.long().argmax(-1)
        cur = torch.where(hit, child, cur)
        path[:, level] = torch.where(hit, child, path[:, level])
        alive &= hit
    num_accepted = (path[:, 1:] >= 0).long().sum(-1)
    bonus = target_ids.gather(1, cur[:, None]).squeeze(1)
    return RoundOutcome(num_accepted, path, bonus)


def tree_uniforms_needed(depth: int, top_k: int) -> int:
    """Uniforms :func:`verify_tree_sampling` consumes per row: (depth + 1) * top_k + 1."""
    return (depth + 1) * top_k + 1


def verify_tree_sampling(tree: DraftTree, target_probs: Tensor, uniforms: Tensor) -> RoundOutcome:
    """Lossless recursive rejection over siblings with point-mass proposals (module docstring).

    Args:
        tree: deterministic draft tree; siblings have distinct tokens.
        target_probs: [B, T, V_t] float32 p at each node (processed).
        uniforms: [B, (D+1)*K + 1] in [0, 1) (see :func:`tree_uniforms_needed`); draw
            ``level * K + s`` tries sibling s at that level, the last one samples the bonus.

    Returns:
        :class:`RoundOutcome`.
    """
    B, T = tree.tokens.shape
    K = tree.children.shape[-1]
    D = tree.max_depth
    dev = tree.tokens.device
    rows = torch.arange(B, device=dev)
    cur = torch.zeros(B, dtype=torch.long, device=dev)
    alive = torch.ones(B, dtype=torch.bool, device=dev)
    path = torch.full((B, D + 1), -1, dtype=torch.long, device=dev)
    path[:, 0] = 0
    residual = target_probs[:, 0].clone()  # [B, V]
    for level in range(1, D + 2):
        moved = torch.zeros(B, dtype=torch.bool, device=dev)
        nxt = cur.clone()
        for s in range(K):
            child = tree.children[rows, cur, s]  # [B]
            tok = tree.tokens.gather(1, child.clamp(min=0)[:, None]).squeeze(1)
            trial = alive & ~moved & (child >= 0)
            p_tok = residual[rows, tok]
            total = residual.sum(-1)
            accept = trial & (uniforms[:, (level - 1) * K + s] * total.double() < p_tok.double())
            reject = trial & ~accept
            residual[rows[reject], tok[reject]] = 0.0  # p' = p without the rejected sibling
            moved |= accept
            nxt = torch.where(accept, child, nxt)
        if level <= D:
            path[:, level] = torch.where(moved, nxt, path[:, level])
        cur = nxt
        residual = torch.where(moved[:, None], target_probs[rows, cur], residual)
        alive &= moved
        if not bool(alive.any()):
            break
    num_accepted = (path[:, 1:] >= 0).long().sum(-1)
    bonus = sample_from_probs(residual, uniforms[:, -1])
    return RoundOutcome(num_accepted, path, bonus)


# ---- tau -------------------------------------------------------------------------------------
def tau_from_committed(committed_per_cycle: Sequence[int]) -> float | None:
    """tau = mean tokens committed per target verification (accepted drafts + 1 bonus).

    Args:
        committed_per_cycle: tokens committed by each verification round (>= 1 each).

    Returns:
        The mean, or None when there was no round.
    """
    if not committed_per_cycle:
        return None
    return sum(committed_per_cycle) / len(committed_per_cycle)


def tau_from_accepted(accepted: Sequence[int]) -> tuple[float | None, int]:
    """(tau, tokens) from accepted draft counts per round: each round also commits its bonus.

    Example: accepted [2, 0, 4] -> tau 3.0 over 9 tokens (3 + 1 + 5).
    """
    committed = [int(a) + 1 for a in accepted]
    return tau_from_committed(committed), sum(committed)


# ---- acceptance metrics: the one implementation decoding, training and benchmarks share -----------
def expected_acceptance_terms(
    ref_logits: Tensor, draft_logits: Tensor, draft_target_ids: Tensor | None = None
) -> Tensor:
    """Per-position probability that a draft token sampled from q is accepted: ``sum_v min(p_v, q_v)``.

    Speculative sampling (Leviathan et al. 2023, Theorem 3.5) accepts with exactly this
    probability. Draft mass is placed at target ids ``draft_target_ids`` when trimmed.

    Args:
        ref_logits: [..., V_t] target logits (temperature 1).
        draft_logits: [..., V_d].
        draft_target_ids: [V_d] or None.

    Returns:
        [...] float32 in [0, 1].
    """
    ref_p = torch.softmax(ref_logits.float(), dim=-1)
    draft_p = torch.softmax(draft_logits.float(), dim=-1)
    if draft_target_ids is not None:
        ref_p = ref_p.index_select(-1, draft_target_ids)
    return torch.minimum(ref_p, draft_p).sum(-1)


def top1_agreement(
    ref_logits: Tensor, draft_logits: Tensor, draft_target_ids: Tensor | None = None
) -> Tensor:
    """Per-position 1.0 where the draft's argmax (as a target id) equals the reference argmax.

    Args:
        ref_logits: [..., V_t].
        draft_logits: [..., V_d].
        draft_target_ids: [V_d] or None.

    Returns:
        [...] float32 of 0/1.
    """
    draft_top = draft_logits.argmax(-1)
    if draft_target_ids is not None:
        draft_top = draft_target_ids[draft_top]
    return (draft_top == ref_logits.argmax(-1)).float()


def chain_tau_from_agreement(agree: Tensor) -> tuple[list[float], list[float], float]:
    """Predicted greedy chain tau from per-step agreement of teacher-forced draft steps.

    A greedy chain of ``k`` drafts accepts draft ``j`` iff drafts ``1..j`` all equal the target's
    tokens. With ``agree[s, n]`` = draft step ``s + 1`` at round start ``n`` equals the target's token
    (the drafter fed the target's tokens before it, i.e. the accepted prefix), the share of rounds
    accepting at least ``j`` drafts is ``p_j = mean_n prod_{s < j} agree[s, n]`` and the expected
    tokens committed per verification is ``tau = 1 + sum_j p_j`` (the bonus token included).

    Args:
        agree: [k, N] bool, one column per round start.

    Returns:
        (prefix_rates p_1..p_k, step_rates a_j = p_j / p_{j-1} (0 where p_{j-1} = 0), tau).

    Raises:
        ValueError: no round start (N = 0) or a tensor that is not 2-D.
    """
    if agree.dim() != 2 or agree.shape[1] == 0:
        raise ValueError(f"agreement tensor of shape {tuple(agree.shape)}: expected [k, N] with N >= 1")
    prefix = agree.bool().cumprod(dim=0).double().mean(dim=1)  # [k]
    rates = prefix.tolist()
    steps = [rates[0]] + [rates[j] / rates[j - 1] if rates[j - 1] > 0 else 0.0 for j in range(1, len(rates))]
    return rates, steps, 1.0 + float(prefix.sum())
