"""``new_drafter_for_target``: the drafter's final norm applies the target's gain whatever its form
(Llama ``w``, Gemma ``1 + w``), so the untrained drafter is the target's logit lens on layer L-3."""

from __future__ import annotations

import pytest
import torch

from finetune.train.init import new_drafter_for_target
from tests.helpers.models import tiny_gemma3_target, tiny_target


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_new_drafter_final_norm_equals_the_targets(family):
    target = tiny_gemma3_target(seed=1) if family == "gemma3" else tiny_target(seed=1)
    with torch.no_grad():  # a visible gain: w random around 0 (Gemma: gain 1 + w) or 1 (Llama)
        target.model.norm.weight.copy_(torch.randn(32) * 0.3 + (0.0 if family == "gemma3" else 1.0))
    drafter = new_drafter_for_target(target)
    x = torch.randn(5, 32)
    assert torch.allclose(drafter.norm(x), target.model.norm(x), atol=1e-5)
    # the untrained drafter reads layer L-3 through the target's final norm and head (a logit lens)
    ids = torch.tensor([[5, 9, 4, 7, 3, 11]])
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
        aux = torch.cat([out.hidden_states[b] for b in drafter.config.aux_layer_ids], dim=-1)
        lens = target.lm_head(target.model.norm(out.hidden_states[3]))
        assert torch.allclose(drafter.logits(drafter.fuse(aux)), lens, atol=1e-4)
    assert drafter.config.aux_layer_ids[-1] == 3  # L - 3 of the 6-layer target


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_standardised_aux_input_has_unit_channels_and_keeps_the_logit_lens(family):
    from finetune.train.init import standardise_aux_input

    target = tiny_gemma3_target(seed=2) if family == "gemma3" else tiny_target(seed=2)
    drafter = new_drafter_for_target(target)
    ids = torch.tensor([[5, 9, 4, 7, 3, 11, 2, 8], [1, 6, 10, 4, 9, 12, 7, 3]])
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
        aux = torch.cat([out.hidden_states[b] for b in drafter.config.aux_layer_ids], dim=-1)
        aux[..., -32 + 7] *= 500.0  # a massive-activation channel in the highest aux state
        before = drafter.logits(drafter.fuse(aux))
        standardise_aux_input(drafter, aux)
        fused = aux @ drafter.fc.weight.T  # the residual stream's start
        assert torch.allclose(fused.reshape(-1, 32).pow(2).mean(0).sqrt(), torch.ones(32), atol=1e-4)
        after = drafter.logits(drafter.fuse(aux))
    # the same logit lens, each token's logits scaled by one positive factor
    rows, cols = before.reshape(-1, before.shape[-1]), after.reshape(-1, after.shape[-1])
    live = rows.abs().amax(0) > 1e-6  # a token whose head row is zero has logit 0 in both
    scale = cols[:, live] / rows[:, live]
    assert torch.all(scale > 0)
    assert torch.allclose(scale, scale[:, :1].expand_as(scale), rtol=1e-3, atol=1e-4)
    assert torch.equal(after.argmax(-1), before.argmax(-1))
    with pytest.raises(ValueError, match="aux is 31 wide, fc reads 96"):
        standardise_aux_input(drafter, aux[..., :31])
