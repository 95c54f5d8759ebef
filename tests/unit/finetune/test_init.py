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
