"""``speculative_generate``'s default ``draft="auto"``: the plan of ``slimspec generate``, made once per
target and drafter, and greedy output still equal to plain ``generate``."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from slimspec_convert.decoding.config import DraftConfig
from slimspec_convert.measure import draft_shape
from slimspec_convert.measure.draft_shape import AUTO_LOOKUPS, calibration_prompts, plan_draft_shape
from slimspec_convert.targets.load import resolve_chat
from slimspec_convert.workflows import hf_generate
from slimspec_convert.workflows.hf_generate import speculative_generate
from tests.helpers.eagle3_layouts import save_tiny_target
from tests.helpers.models import tiny_drafter, tiny_target, tiny_tokenizer


def test_auto_is_the_default_plans_once_and_stays_lossless(tmp_path, monkeypatch):
    folder = save_tiny_target(tiny_target(seed=2), tmp_path / "target")
    tok = tiny_tokenizer()
    tok.save_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()  # name_or_path: the folder
    drafter = tiny_drafter(seed=1)
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(model.get_input_embeddings().weight)
    ids = tok("how many clips did natalia sell", return_tensors="pt")["input_ids"]
    greedy = dict(max_new_tokens=16, do_sample=False, pad_token_id=0)
    monkeypatch.setattr(draft_shape, "read_competing_load", lambda: 0.0)  # quiet machine: the plan is reused
    plans = []
    real = hf_generate.plan_draft_shape
    monkeypatch.setattr(hf_generate, "plan_draft_shape", lambda *a, **k: plans.append(k) or real(*a, **k))
    got = model.generate(input_ids=ids, custom_generate=speculative_generate, drafter=drafter, **greedy)
    again = model.generate(input_ids=ids, custom_generate=speculative_generate, drafter=drafter, **greedy)
    assert torch.equal(got, model.generate(input_ids=ids, **greedy)) and torch.equal(again, got)
    assert len(plans) == 1 and plans[0]["lookups"] == AUTO_LOOKUPS  # planned once, lookup included
    chat = resolve_chat(tok).chat  # the prompt mode `slimspec generate` resolves for this target
    want = plan_draft_shape(model, tok, drafter, calibration_prompts(), lookups=AUTO_LOOKUPS, chat=chat)
    assert want.cached and hf_generate.planned_draft(model, drafter) == want.draft  # the CLI's plan


def test_auto_without_the_targets_tokenizer_names_the_fix():
    model = tiny_target()  # built in memory: no name_or_path to read a tokenizer from
    drafter = tiny_drafter(seed=1)
    with pytest.raises(ValueError, match=r"needs the target's tokenizer.*pass draft=DraftConfig"):
        model.generate(
            input_ids=torch.tensor([[5, 6, 7]]),
            custom_generate=speculative_generate,
            drafter=drafter,
            max_new_tokens=4,
            pad_token_id=0,
        )
    assert hf_generate.planned_draft(model, None) == DraftConfig()  # the target alone: nothing to plan
