"""The transposed linear product: same parameters and sums as nn.Linear, swapped in and out in place,
and greedy speculative decoding with it still equals the target's own greedy decoding."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from slimspec_convert.decoding.config import SamplingConfig
from slimspec_convert.decoding.generator import SpeculativeGenerator
from slimspec_convert.targets.linear_product import (
    TransposedLinear,
    linear_product,
    set_linear_product,
)
from tests.helpers.decoding import CHAIN, HEADS, TREE, V, hf_greedy, mt_bench_ids
from tests.helpers.models import tiny_drafter, tiny_target


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 7), (3, 7), (2, 5, 7), (2, 1, 3, 7)])
def test_transposed_linear_equals_nn_linear(shape, bias):
    g = torch.Generator().manual_seed(0)
    lin = nn.Linear(7, 11, bias=bias)
    x = torch.randn(*shape, generator=g)
    want = lin(x)
    set_linear_product(lin, "transposed")
    assert type(lin) is TransposedLinear and isinstance(lin, nn.Linear)
    got = lin(x)
    assert got.shape == want.shape == (*shape[:-1], 11) and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_set_linear_product_swaps_every_plain_linear_and_back_keeping_the_state_dict():
    class Adapter(nn.Linear):  # another subclass (e.g. a quantised or LoRA layer): left alone
        pass

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 3), Adapter(3, 2)))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert linear_product(model) == "torch"
    assert set_linear_product(model, "transposed") == 2
    assert linear_product(model) == "transposed" and type(model[2][1]) is Adapter
    assert set_linear_product(model, "torch") == 2
    assert [type(m) for m in model.modules() if isinstance(m, nn.Linear)] == [nn.Linear, nn.Linear, Adapter]
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    with pytest.raises(ValueError, match="'auto'"):
        set_linear_product(model, "auto")


@pytest.mark.parametrize("draft", [CHAIN, TREE], ids=["chain", "tree"])
def test_greedy_speculative_decoding_with_the_transposed_product_equals_plain_greedy(draft):
    target = tiny_target(seed=0, vocab_size=V)
    drafter = tiny_drafter(seed=0, **HEADS["dense"])
    prompts = mt_bench_ids(3, V)
    set_linear_product(target, "transposed")
    set_linear_product(drafter, "transposed")
    ref = [hf_greedy(target, p, 24) for p in prompts]
    gen = SpeculativeGenerator(target, None, drafter, draft, SamplingConfig(max_new_tokens=24), batch_size=3)
    res = gen.generate(prompts)
    assert [r.output_ids for r in res] == ref
    # every round verified depth + 1 (chain) or total_tokens + 1 (tree) tokens in one forward
    if draft is TREE:  # guard: some drafts accepted, so multi-token verification decided the output
        assert any(r.stats.cycles < len(r.output_ids) for r in res)
