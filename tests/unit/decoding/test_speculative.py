"""Value tests for speculative.py: processing, sampling, greedy/sampling verification of chains and
trees, tree construction and tau. Golden numbers are hand-computed in the comments."""

from __future__ import annotations

import math

import pytest
import torch

from slimspec_convert.decoding.lookup import graft_sequences
from slimspec_convert.decoding.speculative import (
    build_tree,
    process_logits,
    sample_from_probs,
    tau_from_accepted,
    tau_from_committed,
    tree_uniforms_needed,
    verify_chain_greedy,
    verify_chain_sampling,
    verify_tree_greedy,
    verify_tree_sampling,
)


def test_tau_style_example():
    # STYLE.md section 7: accepted [2, 0, 4] with k = 5 -> (3 + 1 + 5) / 3 = 3.0 over 9 tokens.
    assert tau_from_accepted([2, 0, 4]) == (3.0, 9)
    assert tau_from_committed([]) is None


def test_process_logits_temperature_and_top_p():
    logits = torch.tensor([1.0, 2.0, 5.0]).log()  # softmax -> [1/8, 2/8, 5/8]
    assert process_logits(logits, 1.0).tolist() == pytest.approx([0.125, 0.25, 0.625], abs=1e-6)
    w = [1.0, 2**0.5, 5**0.5]  # temperature 2 -> weights ** (1/2)
    assert process_logits(logits, 2.0).tolist() == pytest.approx([x / sum(w) for x in w], abs=1e-6)
    probs = torch.tensor([0.2, 0.5, 0.3]).log()
    # top_p 0.7: 0.5 (mass before 0) and 0.3 (mass before 0.5 < 0.7) kept, 0.2 (before 0.8) dropped.
    assert process_logits(probs, 1.0, 0.7).tolist() == pytest.approx([0.0, 0.625, 0.375], abs=1e-6)
    # top_p 0.4: only the top token (mass before 0.3 is 0.5 >= 0.4).
    assert process_logits(probs, 1.0, 0.4).tolist() == pytest.approx([0.0, 1.0, 0.0], abs=1e-6)
    with pytest.raises(ValueError, match="temperature=0"):
        process_logits(probs, 0.0)


def test_process_logits_top_k_keeps_ties_then_top_p():
    probs = torch.tensor([0.1, 0.4, 0.2, 0.2, 0.1]).log()
    # top_k 2: the 2nd largest is 0.2, and both 0.2s tie with it -> {0.4, 0.2, 0.2} renormalised /0.8.
    assert process_logits(probs, 1.0, top_k=2).tolist() == pytest.approx([0, 0.5, 0.25, 0.25, 0], abs=1e-6)
    # then top_p 0.6 on [0.5, 0.25, 0.25]: mass before = 0, 0.5, 0.75 -> the 0.5 and one 0.25 (which
    # of the tied pair is up to the sort) -> [2/3, 1/3]. top_k 1 keeps the argmax; top_k >= V is a no-op.
    both = process_logits(probs, 1.0, 0.6, 2)
    assert sorted(v for v in both.tolist() if v > 0) == pytest.approx([1 / 3, 2 / 3], abs=1e-6)
    assert both[1].item() == pytest.approx(2 / 3, abs=1e-6)
    assert process_logits(probs, 1.0, top_k=1).tolist() == [0.0, 1.0, 0.0, 0.0, 0.0]
    assert process_logits(probs, 1.0, top_k=9).tolist() == pytest.approx([0.1, 0.4, 0.2, 0.2, 0.1], abs=1e-6)
    with pytest.raises(ValueError, match="top_k=-1"):
        process_logits(probs, 1.0, top_k=-1)


@pytest.mark.parametrize("temperature, top_p, top_k", [(0.7, 0.9, 20), (1.3, 1.0, 5), (1.0, 0.5, 0)])
def test_process_logits_equals_transformers_warpers(temperature, top_p, top_k):
    # Independent implementation: transformers' own warpers, in the order generate() builds them.
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)) * 3
    logits[0, :3] = logits[0, 3]  # ties at the k-th value
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    ours = process_logits(logits, temperature, top_p, top_k)
    assert torch.equal(ours > 0, torch.softmax(scores, -1) > 0)
    assert torch.allclose(ours, torch.softmax(scores, -1), atol=1e-6)


def test_sample_from_probs_inverse_cdf_skips_zero_mass():
    probs = torch.tensor([0.25, 0.0, 0.75]).expand(5, 3)  # CDF 0.25, 0.25, 1.0
    u = torch.tensor([0.0, 0.2499, 0.25, 0.6, 0.99999])
    assert sample_from_probs(probs, u).tolist() == [0, 0, 2, 2, 2]


def test_verify_chain_greedy_hand_case():
    V = 6
    target_ids = torch.tensor([[3, 1, 0, 5], [4, 4, 4, 4]])  # argmax per position
    logits = torch.nn.functional.one_hot(target_ids, V).float()
    drafts = torch.tensor([[3, 1, 2], [4, 4, 4]])
    out = verify_chain_greedy(drafts, logits)
    assert out.num_accepted.tolist() == [2, 3]
    assert out.bonus.tolist() == [0, 4]
    nodes = torch.cat([torch.tensor([[9], [9]]), drafts], dim=1)
    assert out.committed_tokens(nodes).tolist() == [[3, 1, 0, -1], [4, 4, 4, 4]]
    assert out.path.tolist() == [[0, 1, 2, -1], [0, 1, 2, 3]]


def test_drafter_equal_to_target_gives_tau_k_plus_1():
    g = torch.Generator().manual_seed(0)
    B, k, V = 64, 5, 11
    logits = torch.randn(B, k + 1, V, generator=g) * 3
    greedy = verify_chain_greedy(logits[:, :k].argmax(-1), logits)
    assert greedy.num_accepted.tolist() == [k] * B
    # Sampling: drafts drawn from q = p are always accepted (u * q(x) < p(x) for every u < 1).
    probs = process_logits(logits, 0.9, 0.95)
    drafts = sample_from_probs(probs[:, :k], torch.rand(B, k, generator=g, dtype=torch.float64))
    out = verify_chain_sampling(
        drafts, probs[:, :k], probs, torch.rand(B, k + 1, generator=g, dtype=torch.float64)
    )
    assert out.num_accepted.tolist() == [k] * B
    assert tau_from_committed((out.num_accepted + 1).tolist()) == k + 1


def _hand_tree():
    # Root token 9. Candidates (creation order): depth 1: a=5 (logp -0.1), b=7 (-0.5);
    # depth 2 under a: 6 (-0.3), 8 (-2.0); under b: 1 (-0.6), 2 (-3.0).
    # Best 4 by score: a -0.1, 6 -0.3, b -0.5, 1 -0.6 -> nodes [root, a, b, 6, 1].
    tokens = torch.tensor([[5, 7, 6, 8, 1, 2]])
    scores = torch.tensor([[-0.1, -0.5, -0.3, -2.0, -0.6, -3.0]])
    parents = torch.tensor([[-1, -1, 0, 0, 1, 1]])
    depths = torch.tensor([1, 1, 2, 2, 2, 2])
    return build_tree(torch.tensor([9]), tokens, scores, parents, depths, total_tokens=4, top_k=2)


def test_build_tree_selects_best_and_links_parents():
    tree = _hand_tree()
    assert tree.tokens.tolist() == [[9, 5, 7, 6, 1]]
    assert tree.parents.tolist() == [[-1, 0, 0, 1, 2]]
    assert tree.depths.tolist() == [[0, 1, 1, 2, 2]]
    assert tree.children.tolist() == [[[1, 2], [3, -1], [4, -1], [-1, -1], [-1, -1]]]
    expected = [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 0, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [1, 0, 1, 0, 1],
    ]
    assert tree.ancestors[0].long().tolist() == expected


def test_build_tree_ties_keep_parent():
    # Child score equals its parent's (log-prob 0): the stable sort keeps the parent first.
    tokens = torch.tensor([[4, 3, 2]])
    scores = torch.tensor([[-1.0, -1.0, -1.0]])
    parents = torch.tensor([[-1, 0, 1]])
    tree = build_tree(torch.tensor([0]), tokens, scores, parents, torch.tensor([1, 2, 3]), 2, 1)
    assert tree.tokens.tolist() == [[0, 4, 3]]
    assert tree.parents.tolist() == [[-1, 0, 1]]


def test_verify_tree_greedy_accepts_younger_sibling():
    tree = _hand_tree()  # nodes: 0 root, 1 a=5, 2 b=7, 3 (a->6), 4 (b->1)
    V = 10
    # target argmax: at root 7 (younger sibling b), at b 1 (node 4), at node 4 -> 3 (bonus).
    argmax = torch.tensor([[7, 0, 1, 0, 3]])
    out = verify_tree_greedy(tree, torch.nn.functional.one_hot(argmax, V).float())
    assert out.num_accepted.tolist() == [2]
    assert out.path.tolist() == [[0, 2, 4]]
    assert out.bonus.tolist() == [3]
    assert out.committed_tokens(tree.tokens).tolist() == [[7, 1, 3]]


def test_verify_tree_sampling_point_mass_hand_case():
    tree = _hand_tree()
    V = 10
    p = torch.zeros(1, 5, V)
    p[0, 0, 5], p[0, 0, 7], p[0, 0, 0] = 0.5, 0.3, 0.2  # root: a=5 0.5, b=7 0.3, other 0.2
    p[0, 2, 1], p[0, 2, 3] = 0.4, 0.6  # at b: child 1 has 0.4
    p[0, 4, 8] = 1.0
    K = 2
    u = torch.full((1, tree_uniforms_needed(2, K)), 0.5, dtype=torch.float64)
    # Level 1: a accepted iff u < 0.5 -> u = 0.6 rejects. Residual {b 0.3, other 0.2}: b accepted
    # iff u * 0.5 < 0.3, u = 0.5 accepts. Level 2 at b: node 4 (token 1) accepted iff u < 0.4:
    # u = 0.7 rejects; residual = {3: 0.6} -> bonus 3.
    u[0, 0], u[0, 1], u[0, 2] = 0.6, 0.5, 0.7
    out = verify_tree_sampling(tree, p, u)
    assert out.path.tolist() == [[0, 2, -1]]
    assert out.committed_tokens(tree.tokens).tolist() == [[7, 3, -1]]


# ---- statistical losslessness on a Markov target ---------------------------------------------
V_SMALL = 5
N_TRIALS = 40000


def _markov_tables(temperature: float = 0.8, top_p: float = 0.95, top_k: int = 0):
    """Target and drafter next-token distributions [V, V] (row = current token), logits fixed by hand,
    both processed with the same temperature, top-p and top-k.

    The drafter's vocabulary is trimmed to {0, 1, 2} (logits -inf elsewhere), so q is zero on
    tokens 3 and 4 while the target gives them mass.
    """
    target = torch.tensor(
        [
            [2.0, 1.0, 0.0, 0.5, -1.0],
            [0.0, 2.5, 1.0, -0.5, 1.5],
            [1.0, 0.0, 0.5, 2.0, 0.0],
            [0.3, 0.2, 2.2, 0.0, 1.0],
            [1.5, 1.5, 0.0, 0.0, 0.5],
        ]
    )
    ninf = float("-inf")
    drafter = torch.tensor(
        [
            [0.5, 2.0, 0.0, ninf, ninf],
            [1.0, 1.0, 1.0, ninf, ninf],
            [2.0, 0.0, 0.5, ninf, ninf],
            [0.0, 0.0, 2.0, ninf, ninf],
            [0.0, 2.0, 1.0, ninf, ninf],
        ]
    )
    return process_logits(target, temperature, top_p, top_k), process_logits(
        drafter, temperature, top_p, top_k
    )


def tv_bound(exact: torch.Tensor, n: int, delta: float = 1e-6) -> float:
    # E[TV] <= 1/2 sum_i sqrt(p_i (1 - p_i) / n) (Jensen per cell); TV has bounded differences
    # 1/n per sample, so McDiarmid adds sqrt(ln(1/delta) / (2 n)) with failure probability delta.
    mean_bound = 0.5 * float((exact * (1 - exact) / n).sqrt().sum())
    return mean_bound + math.sqrt(math.log(1 / delta) / (2 * n))


def _first_two_tokens(round_fn, n: int, start: int, g: torch.Generator) -> torch.Tensor:
    """Run rounds until every trial has 2 committed tokens; returns [n, 2]."""
    got = torch.full((n, 2), -1, dtype=torch.long)
    filled = torch.zeros(n, dtype=torch.long)
    root = torch.full((n,), start, dtype=torch.long)
    while bool((filled < 2).any()):
        committed = round_fn(root, g)  # [n, W], -1 padded
        for j in range(committed.shape[1]):
            tok = committed[:, j]
            take = (tok >= 0) & (filled < 2)
            got[take, filled[take]] = tok[take]
            filled += take.long()
        counts = (committed >= 0).sum(-1)
        root = committed.gather(1, (counts - 1)[:, None]).squeeze(1)
    return got


def empirical_tv(samples: torch.Tensor, exact: torch.Tensor) -> float:
    V = exact.shape[-1]
    counts = torch.bincount(samples[:, 0] * V + samples[:, 1], minlength=V * V).double()
    return 0.5 * float((counts / samples.shape[0] - exact.flatten()).abs().sum())


def _chain_round(target_p, draft_q, k):
    def round_fn(root, g):
        n = root.shape[0]
        u_draft = torch.rand(n, k, generator=g, dtype=torch.float64)
        drafts, cur = [], root
        for i in range(k):
            cur = sample_from_probs(draft_q[cur], u_draft[:, i])
            drafts.append(cur)
        drafts = torch.stack(drafts, dim=1)  # [n, k]
        ctx = torch.cat([root[:, None], drafts], dim=1)  # [n, k+1]
        q = draft_q[ctx[:, :k]]  # [n, k, V]
        out = verify_chain_sampling(
            drafts, q, target_p[ctx], torch.rand(n, k + 1, generator=g, dtype=torch.float64)
        )
        return out.committed_tokens(ctx)

    return round_fn


def _tree_round(target_p, draft_q, K):
    log_q = draft_q.log().clamp(max=0)

    def round_fn(root, g, verify=None):
        n = root.shape[0]
        top1 = log_q[root].topk(K, dim=-1)  # depth 1: [n, K]
        child = log_q[top1.indices].topk(K, dim=-1)  # depth 2 under each: [n, K, K]
        tokens = torch.cat([top1.indices, child.indices.reshape(n, K * K)], dim=1)
        scores = torch.cat([top1.values, (top1.values[:, :, None] + child.values).reshape(n, K * K)], dim=1)
        parents = torch.cat(
            [torch.full((n, K), -1), torch.arange(K).repeat_interleave(K).expand(n, K * K)], dim=1
        )
        depths = torch.tensor([1] * K + [2] * K * K)
        tree = build_tree(root, tokens, scores, parents, depths, total_tokens=4, top_k=K)
        if verify is not None:
            out, tree = verify(tree)
            return out.committed_tokens(tree.tokens)
        u = torch.rand(n, tree_uniforms_needed(2, K), generator=g, dtype=torch.float64)
        out = verify_tree_sampling(tree, target_p[tree.tokens], u)
        return out.committed_tokens(tree.tokens)

    return round_fn


def _lookup_round(target_p, draft_q, K):
    """The tree round with a deterministic 'lookup' path grafted per row (none after token 2), so
    grafted nodes share the drafter's, add siblings, and rows get padding."""
    tree_round = _tree_round(target_p, draft_q, K)

    def round_fn(root, g):
        def verify(tree):
            seqs = [[] if r == 2 else [(r + 1) % V_SMALL, (r + 3) % V_SMALL] for r in root.tolist()]
            grafted, _ = graft_sequences(tree, seqs, width=K + 1)
            u = torch.rand(root.shape[0], tree_uniforms_needed(2, K + 1), generator=g, dtype=torch.float64)
            return verify_tree_sampling(grafted, target_p[grafted.tokens], u), grafted

        return tree_round(root, g, verify)

    return round_fn


@pytest.mark.parametrize("processing", [(0.8, 0.95, 0), (1.0, 1.0, 3)], ids=["top_p", "top_k"])
@pytest.mark.parametrize("method", ["chain", "tree", "tree+lookup"])
def test_sampling_is_lossless_on_markov_target(method, processing):
    target_p, draft_q = _markov_tables(*processing)
    if processing[2]:  # guard: top-k really removed target mass (2 of 5 tokens per row)
        assert bool(((target_p > 0).sum(-1) == 3).all())
    start = 0
    exact = target_p[start][:, None] * target_p  # P(y1, y2) = p(y1 | 0) p(y2 | y1), [V, V]
    g = torch.Generator().manual_seed(1234)
    rounds = {
        "chain": lambda: _chain_round(target_p, draft_q, 3),
        "tree": lambda: _tree_round(target_p, draft_q, 2),
    }
    rounds["tree+lookup"] = lambda: _lookup_round(target_p, draft_q, 2)
    round_fn = rounds[method]()
    samples = _first_two_tokens(round_fn, N_TRIALS, start, g)
    tv = empirical_tv(samples, exact)
    bound = tv_bound(exact.flatten(), N_TRIALS)
    assert bound < 0.03  # the test can tell a 0.05 error from sampling noise
    assert tv < bound, f"{method}: TV {tv:.4f} >= bound {bound:.4f}"
    # Guard: drafts were really accepted (else the test would only check plain sampling).
    first_round = round_fn(torch.full((2000,), start), g)
    assert float(((first_round >= 0).sum(-1) >= 2).double().mean()) > 0.3
