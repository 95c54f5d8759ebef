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


def test_rerank_errors():
    head, E, _ = _head_and_rows()
    with pytest.raises(ValueError, match=r"rerank k=129 is outside \[0, V_d=128\]"):
        head.set_rerank(V + 1, E)
    with pytest.raises(
        ValueError, match=r"rerank rows have shape \[128, 16\], expected \[V_d, d\] = \[128, 32\]"
    ):
        head.set_rerank(4, nn.Embedding(V, 16))
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
