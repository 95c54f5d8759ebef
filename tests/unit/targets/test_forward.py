"""targets.forward: logits at gathered hidden states in the head's dtype."""

import torch

from slimspec_convert.targets.forward import target_logits_at
from tests.helpers.models import tiny_target


def test_target_logits_at_casts_float32_features_to_a_bf16_head():
    target = tiny_target()
    h = torch.randn(3, target.config.hidden_size)
    expect = target.lm_head(h)
    target = target.to(torch.bfloat16)  # e.g. a bf16 target reading float32 cached features
    got = target_logits_at(target, h)
    assert got.dtype == torch.float32 and got.shape == expect.shape
    assert torch.allclose(got, expect, rtol=5e-2, atol=5e-2)
    assert torch.equal(got, target.lm_head(h.bfloat16()).float())
