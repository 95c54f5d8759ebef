"""Run an EAGLE-3 drafter inside the decoding loop: real-feature forwards, chain drafting and the
EAGLE-2/3 dynamic tree, with the drafter's KV cache cropped back to the accepted prefix.

Alignment (eagle3-formats.md 5.2): drafter slot t pairs the target feature g_t with token x_{t+1}
at RoPE position t and predicts x_{t+2}. With the root (last committed token) at position R, the
drafter cache holds real slots 0..R-1 and ``h_last`` (slot R-1) scores the first draft; draft
level i >= 2 feeds ``next_hidden`` of its parent's step and the parent's token at position
R + i - 2. Draft slots are cropped after every round, so the cache only ever keeps slots computed
from the target's own features.
"""

from __future__ import annotations

import torch
from torch import Tensor

from slimspec_convert.decoding.config import DraftConfig, SamplingConfig
from slimspec_convert.decoding.results import StageTimes
from slimspec_convert.decoding.speculative import DraftTree, build_tree, process_logits, sample_from_probs
from slimspec_convert.devices import clock_ms, module_device
from slimspec_convert.model.drafter import Eagle3Drafter
from slimspec_convert.model.head import LowRankHead
from slimspec_convert.model.kv_cache import DraftKVCache
from slimspec_convert.model.vocab_pick import block_max, block_topk

STAGES = ("target aux states", "drafter fc", "drafter decoder layer", "drafter lm_head")  # pipeline order


_WIDER = {torch.float16: "bfloat16 or float32", torch.bfloat16: "float32"}


class NonFiniteDecodeError(ValueError):
    """NaN/inf came out of a decoding stage; the message names the stage and the dtype.

    Attributes:
        stage: one of :data:`STAGES` or ``"target logits"``.
        dtype: the dtype the stage ran in.
    """

    def __init__(self, stage: str, dtype: torch.dtype) -> None:
        name = str(dtype).removeprefix("torch.")
        if dtype in _WIDER:
            hint = f"the values overflow {name}; rerun with --dtype {_WIDER[dtype]}"
        else:
            hint = "check the drafter's weights and the target's hidden states for NaN/inf"
        super().__init__(f"NaN/inf in the {stage} output while decoding in {name}: {hint}")
        self.stage, self.dtype = stage, dtype


def check_finite_logits(logits: Tensor, stage: str = "target logits") -> None:
    """Raise :class:`NonFiniteDecodeError` unless every entry is finite (one host sync).

    Raises:
        NonFiniteDecodeError: NaN/inf in ``logits``.
    """
    if not bool(torch.isfinite(logits).all()):
        raise NonFiniteDecodeError(stage, logits.dtype)


def block_mask(
    prefix_valid: Tensor | None, block_valid: Tensor | None, B: int, m: int, S: int, device=None
) -> Tensor | None:
    """Bool attention mask for m causal queries appended after S cached slots.

    Args:
        prefix_valid: [B, S] bool (True = real slot) or None when every cached slot is real.
        block_valid: [B, m] bool for the new slots, or None when all are real.
        B, m, S: batch, new slots, cached slots.
        device: where to build the mask.

    Returns:
        [B, 1, m, S + m] bool (True = may attend); every query sees itself. None when both inputs
        are None (plain causal attention over the cache).
    """
    if prefix_valid is None and block_valid is None:
        return None
    causal = torch.ones(m, m, dtype=torch.bool, device=device).tril()
    block = causal.expand(B, m, m)
    if block_valid is not None:
        block = (block & block_valid[:, None, :]) | torch.eye(m, dtype=torch.bool, device=device)
    if prefix_valid is not None:
        prefix = prefix_valid[:, None, :].expand(B, m, S)
    else:
        prefix = torch.ones(B, m, S, dtype=torch.bool, device=device)
    return torch.cat([prefix, block], dim=-1)[:, None]


class DrafterRunner:
    """Drives one drafter: timing of backbone vs lm_head, chain and tree drafting.

    Args:
        drafter: the EAGLE-3 drafter (dense, trimmed or low-rank head).
        draft: drafting shape (``depth`` = k for a chain).
        sampling: temperature 0 = greedy drafting; otherwise drafts use the processed q.
        times: accumulator shared with the caller.

    Every stage's output is watched for NaN/inf on the device (no sync) and checked once per round,
    before the drafts leave :meth:`draft_chain` / :meth:`draft_tree`: a float16 drafter that
    overflows stops with :class:`NonFiniteDecodeError` instead of proposing id 0 every round.

    Raises:
        ValueError: top_k larger than the draft vocabulary, or total_tokens larger than the
            k + (depth - 1) k^2 candidates a tree drafts.
    """

    def __init__(
        self, drafter: Eagle3Drafter, draft: DraftConfig, sampling: SamplingConfig, times: StageTimes
    ):
        self.drafter = drafter
        self.draft = draft
        self.sampling = sampling
        self.times = times
        cfg = drafter.config
        self.vocab_size = cfg.vocab_size
        if draft.method == "tree":
            if draft.top_k > cfg.draft_vocab_size:
                raise ValueError(
                    f"DraftConfig.top_k={draft.top_k} exceeds draft_vocab_size={cfg.draft_vocab_size}"
                )
            n_cand = draft.top_k + (draft.depth - 1) * draft.top_k**2
            if draft.total_tokens > n_cand:
                raise ValueError(
                    f"DraftConfig.total_tokens={draft.total_tokens} exceeds the top_k + (depth-1)*top_k^2 = "
                    f"{n_cand} candidates of a depth-{draft.depth}, top_k-{draft.top_k} tree; lower it"
                )
        hot = None
        if drafter.d2t is not None:
            hot = drafter.to_target_ids(torch.arange(cfg.draft_vocab_size, device=drafter.d2t.device))
        self.hot_ids = hot  # [V_d] absolute target ids, or None (identity)
        self.device = module_device(drafter)  # stage clocks synchronise it (CUDA runs asynchronously)
        self._finite: dict[str, tuple[Tensor, torch.dtype]] = {}  # stage -> (all finite so far, dtype)
        self.context: tuple[Tensor, Tensor] | None = None  # this round's rerank context pool

    @property
    def context_size(self) -> int:
        """Most distinct sequence tokens the lm_head's rerank rescores (0: it takes none)."""
        head = self.drafter.lm_head
        return head.rerank_context if isinstance(head, LowRankHead) and head.rerank_k else 0

    def set_context(self, ids: Tensor | None) -> None:
        """This round's rerank context pool: [B, C] int64 target ids per active row, or None.

        The rows are gathered here, once per round (timed as lm_head).
        """
        if ids is None:
            self.context = None
            return
        t0 = clock_ms(self.device)
        self.context = (ids, self.drafter.lm_head.context_rows(ids))
        self.times.drafter_head_ms += clock_ms(self.device) - t0

    # ---- NaN/inf watch ---------------------------------------------------------------------
    def _watch(self, stage: str, t: Tensor) -> Tensor:
        """Fold ``isfinite(t).all()`` into the stage's flag, on the device (no host sync)."""
        ok = torch.isfinite(t).all()
        if stage in self._finite:
            ok = ok & self._finite[stage][0]
        self._finite[stage] = (ok, t.dtype)
        return t

    def check_finite(self) -> None:
        """One host sync: raise for the first stage, in pipeline order, whose output held NaN/inf.

        Raises:
            NonFiniteDecodeError: naming the stage and its dtype.
        """
        flags, self._finite = self._finite, {}
        if not flags or bool(torch.stack([ok for ok, _ in flags.values()]).all()):
            return
        stage = next(s for s in STAGES if s in flags and not bool(flags[s][0]))
        raise NonFiniteDecodeError(stage, flags[stage][1])

    # ---- timed pieces ---------------------------------------------------------------------
    def forward(self, tokens: Tensor, hidden: Tensor, positions: Tensor, cache: DraftKVCache, mask) -> Tensor:
        """Drafter backbone on [B, T] tokens with [B, T, d] features -> [B, T, d] (timed)."""
        t0 = clock_ms(self.device)
        h = self.drafter(tokens, hidden, positions, cache, mask)
        self.times.drafter_backbone_ms += clock_ms(self.device) - t0
        return self._watch("drafter decoder layer", h)

    def fuse(self, aux: Tensor) -> Tensor:
        """Fuse target aux states [B, T, K*dt] -> [B, T, d] (timed as backbone)."""
        t0 = clock_ms(self.device)
        g = self.drafter.fuse(self._watch("target aux states", aux))
        self.times.drafter_backbone_ms += clock_ms(self.device) - t0
        return self._watch("drafter fc", g)

    def logits(self, h: Tensor, watch: bool = True) -> Tensor:
        """Draft-vocabulary logits [..., V_d] float32; the lm_head is timed on its own.

        ``watch=False`` leaves the NaN/inf check to the caller (:meth:`greedy_ids` checks the row
        maxima only).
        """
        t0 = clock_ms(self.device)
        z = self.drafter.norm(h)
        t1 = clock_ms(self.device)
        out = self.drafter.lm_head(z) if self.context is None else self.drafter.lm_head(z, self.context)
        t2 = clock_ms(self.device)
        self.times.drafter_backbone_ms += t1 - t0
        self.times.drafter_head_ms += t2 - t1
        return (self._watch("drafter lm_head", out) if watch else out).float()

    def greedy_ids(self, h: Tensor) -> Tensor:
        """Argmax draft-vocabulary ids [...] int64 of the logits of ``h`` [..., d].

        The index is ``argmax``'s (the first maximal entry), found over blocks of the row
        (:func:`~slimspec_convert.model.vocab_pick.block_max`: about 0.02 ms on a 262k row on 2 CPU
        cores, against 0.36 ms for a NaN/inf check over the row and an ``argmax``). The NaN/inf
        watch looks at the row maxima: a NaN anywhere in a row, a +inf, or a row of -inf is caught,
        while a -inf among finite logits (which no argmax picks) is not. The pick is timed with the
        lm_head: its cost grows with the head's rows as the product's does (the cost model's
        T_head is what a head costs a draft step).
        """
        logits = self.logits(h, watch=False)
        t0 = clock_ms(self.device)
        values, idx = block_max(logits)
        self.times.drafter_head_ms += clock_ms(self.device) - t0
        self._watch("drafter lm_head", values)
        return idx

    def log_probs(self, logits: Tensor) -> Tensor:
        """Tree scores: log of the drafting distribution (raw softmax when greedy), <= 0."""
        if self.sampling.temperature == 0:
            return torch.log_softmax(logits, dim=-1)
        q = process_logits(logits, self.sampling.temperature, self.sampling.top_p, self.sampling.top_k)
        return q.log().clamp_(max=0.0)

    def to_target(self, draft_ids: Tensor) -> Tensor:
        """Draft-vocabulary indices -> target ids (i + d2t[i])."""
        return draft_ids if self.hot_ids is None else self.hot_ids[draft_ids]

    def scatter_probs(self, q: Tensor) -> Tensor:
        """[..., V_d] q -> [..., V_t], zero outside the draft vocabulary."""
        if self.hot_ids is None:
            return q
        out = q.new_zeros(*q.shape[:-1], self.vocab_size)
        out[..., self.hot_ids] = q
        return out

    # ---- real-feature forward --------------------------------------------------------------
    def real_forward(
        self, cache: DraftKVCache, aux: Tensor, tokens: Tensor, positions: Tensor, mask: Tensor | None
    ) -> Tensor:
        """Append slots computed from the target's features; returns ``h_last`` [B, d] (last slot)."""
        h = self.forward(tokens, self.fuse(aux), positions, cache, mask)
        return h[:, -1]

    # ---- chain -----------------------------------------------------------------------------
    def draft_chain(
        self,
        cache: DraftKVCache,
        h_last: Tensor,
        root_pos: Tensor,
        prefix_valid: Tensor | None,
        uniforms: Tensor | None,
    ) -> tuple[Tensor, Tensor | None]:
        """Draft k = ``depth`` tokens one after another.

        Args:
            cache: drafter cache holding S real slots; cropped back to S before returning.
            h_last: [B, d] output at the last real slot.
            root_pos: [B] int64 position R of the root.
            prefix_valid: [B, S] bool or None (all real).
            uniforms: [B, k] float64 for sampling the drafts (None when greedy).

        Returns:
            (draft ids [B, k] target ids, q [B, k, V_t] float32 or None when greedy).

        Raises:
            NonFiniteDecodeError: NaN/inf in a stage since the last check.
        """
        k = self.draft.depth
        B, dev = h_last.shape[0], h_last.device
        S = cache.length()
        h = h_last
        ids, qs = [], []
        for i in range(k):
            if uniforms is None:
                idx = self.greedy_ids(h)  # [B]
            else:
                q = process_logits(
                    self.logits(h), self.sampling.temperature, self.sampling.top_p, self.sampling.top_k
                )  # [B, V_d]
                idx = sample_from_probs(q, uniforms[:, i])
                qs.append(self.scatter_probs(q))
            tok = self.to_target(idx)
            ids.append(tok)
            if i + 1 < k:
                mask = None
                if prefix_valid is not None:
                    mask = torch.cat(
                        [prefix_valid, torch.ones(B, i + 1, dtype=torch.bool, device=dev)], dim=1
                    )
                    mask = mask[:, None, None]
                pos = (root_pos + i)[:, None]  # feeding draft i+1 at R + i
                h = self.forward(tok[:, None], self.drafter.next_hidden(h)[:, None], pos, cache, mask)[:, 0]
        cache.crop(S)
        self.check_finite()
        return torch.stack(ids, dim=1), (torch.stack(qs, dim=1) if qs else None)

    # ---- tree ------------------------------------------------------------------------------
    def draft_tree(
        self,
        cache: DraftKVCache,
        h_last: Tensor,
        root_tok: Tensor,
        root_pos: Tensor,
        prefix_valid: Tensor | None,
    ) -> DraftTree:
        """EAGLE-2/3 dynamic tree: expand the top_k best nodes per level, keep the best N overall.

        Args:
            cache: drafter cache holding S real slots; cropped back to S before returning.
            h_last: [B, d] output at the last real slot.
            root_tok: [B] int64 root token.
            root_pos: [B] int64 position R of the root.
            prefix_valid: [B, S] bool or None (all real).

        Returns:
            :class:`DraftTree` with N = ``total_tokens`` nodes plus the root.

        Raises:
            NonFiniteDecodeError: NaN/inf in a stage since the last check.
        """
        K, D = self.draft.top_k, self.draft.depth
        B, dev = h_last.shape[0], h_last.device
        S = cache.length()
        top_values, top_ids = block_topk(self.log_probs(self.logits(h_last)), K)  # [B, K] each
        tokens, scores = [self.to_target(top_ids)], [top_values]
        parents = [torch.full((B, K), -1, dtype=torch.long, device=dev)]
        depths = [torch.ones(K, dtype=torch.long, device=dev)]
        fed = torch.arange(K, device=dev).expand(B, K)  # candidate ids of the nodes fed next
        fed_scores = top_values  # [B, K]
        fed_tokens = tokens[0]
        hidden = self.drafter.next_hidden(h_last)[:, None].expand(B, K, h_last.shape[-1])
        anc = torch.zeros(B, K, 0, dtype=torch.bool, device=dev)  # fed node -> earlier draft slots it may see
        eye = torch.eye(K, dtype=torch.bool, device=dev).expand(B, K, K)
        prefix = (
            prefix_valid if prefix_valid is not None else torch.ones(B, S, dtype=torch.bool, device=dev)
        )[:, None]
        base = K
        for level in range(2, D + 1):
            mask = torch.cat([prefix.expand(B, K, S), anc, eye], dim=-1)[:, None]  # [B, 1, K, S + ...]
            pos = (root_pos + level - 2)[:, None].expand(B, K)
            h = self.forward(fed_tokens, hidden, pos, cache, mask)  # [B, K, d]
            child_values, child_ids = block_topk(self.log_probs(self.logits(h)), K)  # [B, K, K] each
            cand_scores = (fed_scores[:, :, None] + child_values).reshape(B, K * K)
            tokens.append(self.to_target(child_ids).reshape(B, K * K))
            scores.append(cand_scores)
            parents.append(fed[:, :, None].expand(B, K, K).reshape(B, K * K))
            depths.append(torch.full((K * K,), level, dtype=torch.long, device=dev))
            if level < D:
                best = cand_scores.topk(K, dim=-1).indices  # [B, K] among this level's K^2
                src = best // K  # which fed node is the parent
                fed = base + best
                fed_scores = cand_scores.gather(1, best)
                fed_tokens = tokens[-1].gather(1, best)
                nh = self.drafter.next_hidden(h)
                hidden = nh.gather(1, src[:, :, None].expand(B, K, nh.shape[-1]))
                own = torch.nn.functional.one_hot(src, K).bool()  # the parent's own slot this level
                anc = torch.cat([anc.gather(1, src[:, :, None].expand(B, K, anc.shape[-1])), own], dim=-1)
            base += K * K
        cache.crop(S)
        self.check_finite()
        return build_tree(
            root_tok,
            torch.cat(tokens, dim=1),
            torch.cat(scores, dim=1),
            torch.cat(parents, dim=1),
            torch.cat(depths),
            self.draft.total_tokens,
            K,
        )
