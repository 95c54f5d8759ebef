"""Shortlist rerank of a low-rank head (SVD-softmax preview + exact rescoring of the top k rows):
the exact function it computes, that it is inference-only, its errors, and that speculative
decoding with it stays lossless and, at k = V, drafts exactly what the dense head drafts."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from slimspec_convert.decoding.config import DraftConfig, SamplingConfig
from slimspec_convert.decoding.generator import SpeculativeGenerator
from slimspec_convert.lowrank.svd import lowrank_factorize
from slimspec_convert.model.drafter import Eagle3Drafter
from slimspec_convert.model.head import LowRankHead
from tests.helpers.models import tiny_drafter, tiny_target

V, D = 128, 32


def _tied_pair(rank: int) -> tuple[Eagle3Drafter, Eagle3Drafter]:
    """A dense drafter whose lm_head is its embedding table (tied, as the SmolLM2 demo drafter),
    and its rank-``rank`` SVD copy."""
    full = tiny_drafter(seed=0)
    with torch.no_grad():
        full.lm_head.weight.copy_(full.embed_tokens.weight)
    fac = lowrank_factorize(full.lm_head.weight.detach(), rank)
    low = Eagle3Drafter(full.config.replace(head_rank=rank, head_is_embedding=True))
    state = {k: v for k, v in full.state_dict().items() if k != "lm_head.weight"}
    state.update({"lm_head.up.weight": fac.W_up, "lm_head.down.weight": fac.W_down})
    low.load_state_dict(state, strict=True)
    return full.eval(), low.eval()


def _head_and_rows(seed: int = 0) -> tuple[LowRankHead, nn.Embedding, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    E = nn.Embedding(V, D)
    with torch.no_grad():
        E.weight.copy_(torch.randn(V, D, generator=g))
    head = LowRankHead.from_factorization(lowrank_factorize(E.weight.detach(), 4)).eval()
    return head, E, torch.randn(5, D, generator=g)


def test_rerank_rescores_exactly_the_top_k_and_keeps_the_rest_bit_for_bit():
    head, E, h = _head_and_rows()
    low = head(h)  # [5, V], rerank off
    head.set_rerank(7, E)
    out = head(h)
    top = low.topk(7, dim=-1).indices
    in_top = torch.zeros_like(low, dtype=torch.bool).scatter(-1, top, True)
    assert torch.equal(out[~in_top], low[~in_top])
    exact = h @ E.weight.T  # [5, V]
    assert torch.allclose(out[in_top], exact[in_top], atol=1e-5)
    assert not torch.allclose(out[in_top], low[in_top], atol=1e-2)  # the rescoring did change them
    assert head.rerank_k == 7


def test_rerank_over_the_whole_vocabulary_is_the_dense_head():
    head, E, h = _head_and_rows(1)
    head.set_rerank(V, E)
    assert torch.allclose(head(h), h @ E.weight.T, atol=1e-5)
    head.set_rerank(0, E)
    assert head.rerank_k == 0 and torch.equal(head(h), head.up(head.down(h)))


def test_rerank_is_off_in_training_mode_and_not_saved():
    head, E, h = _head_and_rows(2)
    head.set_rerank(V, E)
    head.train()
    assert torch.equal(head(h), head.up(head.down(h)))  # the fine-tune trains the preview itself
    assert sorted(head.state_dict()) == ["down.weight", "up.weight"]
    assert [n for n, _ in head.named_modules()] == ["", "down", "up"]  # rows are not a submodule


def test_rerank_context_rescores_the_sequence_tokens_of_each_row_too():
    head, E, h = _head_and_rows(3)
    head.set_rerank(3, E, context=8)
    h = h[:4].reshape(2, 2, D)  # [B=2, M=2, d]: two batch rows, two tree nodes each
    ids = torch.tensor([[5, 9, 9], [40, 2, 77]])  # row 0 repeats 9 as padding
    top_only = head(h)
    out = head(h, (ids, head.context_rows(ids)))
    exact = h @ E.weight.T  # [2, 2, V]
    pool = top_only != head.up(head.down(h))  # the top-3 rows top_only rescored
    for b in range(2):
        pool[b, :, ids[b]] = True
    assert torch.allclose(out[pool], exact[pool], atol=1e-5)
    assert torch.equal(out[~pool], top_only[~pool])  # the rest is the preview, bit for bit
    assert int((~pool).sum()) > 2 * 2 * (V - 3 - 3)  # the pools are small
    assert head.rerank_context == 8 and head.context_rows(ids).shape == (2, 3, D)
    with pytest.raises(ValueError, match=r"rerank context ids \[3, 3\] .* expected \[B, C\]"):
        head(h, (ids[[0, 1, 1]], head.context_rows(ids[[0, 1, 1]])))
    head.set_rerank(0, E, context=8)
    assert head.rerank_context == 0 and head.context_rows(ids) is None
    assert torch.equal(head(h, None), head.up(head.down(h)))


def test_rerank_errors():
    head, E, _ = _head_and_rows()
    with pytest.raises(ValueError, match=r"rerank k=129 is outside \[0, V_d=128\]"):
        head.set_rerank(V + 1, E)
    with pytest.raises(
        ValueError, match=r"rerank rows have shape \[128, 16\], expected \[V_d, d\] = \[128, 32\]"
    ):
        head.set_rerank(4, nn.Embedding(V, 16))
    with pytest.raises(ValueError, match=r"rerank context=-1: expected >= 0"):
        head.set_rerank(4, E, context=-1)
    with pytest.raises(ValueError, match="needs a low-rank lm_head"):
        tiny_drafter().enable_rerank(4)
    trimmed = tiny_drafter(draft_vocab_size=64, head_rank=4, head_is_embedding=True)
    with pytest.raises(ValueError, match=r"full-vocabulary head \(draft_vocab_size 64 < vocab_size 128\)"):
        trimmed.enable_rerank(4)
    with pytest.raises(
        ValueError, match=r"rerank rescores with embed_tokens rows, but the dense head .* is not"
    ):
        tiny_drafter(head_rank=4, head_is_embedding=False).enable_rerank(4)
    with pytest.raises(ValueError, match="head_is_embedding unset"):
        tiny_drafter(head_rank=4).enable_rerank(4)  # never recorded (not converted by slimspec convert)


def _generate(model, drafter, prompts, draft):
    gen = SpeculativeGenerator(model, None, drafter, draft, SamplingConfig(max_new_tokens=24), batch_size=1)
    return gen.generate(prompts)


@pytest.mark.parametrize(
    "draft",
    [DraftConfig(method="chain", depth=4), DraftConfig(method="tree", depth=4, top_k=3, total_tokens=10)],
    ids=["chain", "tree"],
)
def test_greedy_with_rerank_is_lossless_and_full_rerank_drafts_like_the_dense_head(draft):
    model = tiny_target(seed=3, vocab_size=V)
    prompts = [[5, 9, 4, 7, 3], [8, 6, 3, 11], [2, 14, 1]]
    full, low = _tied_pair(rank=4)
    plain = _generate(model, None, prompts, draft)
    dense = _generate(model, full, prompts, draft)
    preview = _generate(model, low, prompts, draft)  # rerank off: the rank-4 head alone
    low.enable_rerank(V)
    exact = _generate(model, low, prompts, draft)
    low.enable_rerank(8)
    short = _generate(model, low, prompts, draft)
    ref = [r.output_ids for r in plain]
    for res in (dense, preview, exact, short):
        assert [r.output_ids for r in res] == ref
    # k = V rescored every row: the same drafts, hence the same acceptance round by round
    # (the rank-4 head alone drafts differently, so this can fail).
    commits = {
        n: [r.stats.committed_per_cycle for r in res]
        for n, res in (("dense", dense), ("preview", preview), ("exact", exact))
    }
    assert commits["exact"] == commits["dense"] != commits["preview"]


def test_a_context_pool_holding_the_vocabulary_drafts_like_the_dense_head():
    """k = 1 alone drafts from the rank-4 preview; with every id in the prompt, the context pool
    rescores the whole vocabulary each round: the dense head's drafts, round by round."""
    model = tiny_target(seed=3, vocab_size=V)
    draft = DraftConfig(method="tree", depth=4, top_k=3, total_tokens=10)
    prompts = [list(range(V)), list(range(V - 1, -1, -1))]
    full, low = _tied_pair(rank=4)
    dense = _generate(model, full, prompts, draft)
    low.enable_rerank(1, context=0)
    short = _generate(model, low, prompts, draft)
    low.enable_rerank(1, context=V)
    pooled = _generate(model, low, prompts, draft)
    low.enable_rerank(1, context=2)  # the two most recent distinct tokens only
    recent = _generate(model, low, prompts, draft)
    ref = [r.output_ids for r in dense]
    assert [r.output_ids for r in short] == [r.output_ids for r in pooled] == ref
    assert [r.output_ids for r in recent] == ref
    commits = {
        n: [r.stats.committed_per_cycle for r in res]
        for n, res in (("dense", dense), ("short", short), ("pooled", pooled))
    }
    assert commits["pooled"] == commits["dense"] != commits["short"]


def test_the_context_pool_is_each_rows_most_recent_distinct_tokens():
    model = tiny_target(seed=3, vocab_size=V)
    _, low = _tied_pair(rank=4)
    low.enable_rerank(2, context=3)
    gen = SpeculativeGenerator(model, None, low, DraftConfig(), SamplingConfig(max_new_tokens=8))
    prompts = [[5, 9, 5, 7, 9], [3]]
    st = gen.start(prompts)
    first = st.root_tok.tolist()  # committed at prefill

    def last_distinct(seq, n):
        out = []
        for t in reversed(seq):
            if t not in out:
                out.append(t)
        return out[:n][::-1]

    want = [last_distinct(p + [f], 3) for p, f in zip(prompts, first, strict=True)]
    C = max(map(len, want))
    got = st.context_ids(3, "cpu").tolist()
    assert got == [w + w[-1:] * (C - len(w)) for w in want]  # short rows repeat their last id
    gen.step(st)
    outs = [st.outputs[row] for row in st.rows]
    assert st.context_ids(3, "cpu")[0].tolist()[: len(last_distinct(prompts[0] + outs[0], 3))] == (
        last_distinct(prompts[0] + outs[0], 3)
    )
