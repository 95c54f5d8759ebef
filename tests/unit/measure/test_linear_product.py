"""--linear-product auto: timed once per machine and cached, applied to the target and the drafters,
recorded in the e2e result; only float32 on the CPU is timed."""

from __future__ import annotations

import json

import pytest
import torch

from slimspec_convert.decoding.config import GenerateConfig
from slimspec_convert.measure import linear_product as lp
from slimspec_convert.measure.e2e import BenchE2EConfig
from slimspec_convert.measure.linear_product import (
    CHOICE_TOKENS,
    LinearProductChoice,
    apply_linear_product,
    choose_linear_product,
)
from slimspec_convert.targets.linear_product import linear_product
from tests.helpers.models import tiny_drafter, tiny_target


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    """A quiet machine (load 0) unless a test says otherwise: a cache timed under load is not reused."""
    monkeypatch.setattr(lp, "read_competing_load", lambda: 0.0)


def test_auto_times_both_products_once_caches_the_choice_and_sets_it_on_every_model(tmp_path, monkeypatch):
    target, drafter = tiny_target(), tiny_drafter(seed=1)
    slow = {"torch": 5.0, "transposed": 2.0}

    def fake_cost(model, tokens, context):  # the transposed product is the faster one here
        assert tuple(tokens) == CHOICE_TOKENS
        ms = tuple(slow[linear_product(model)] * n for n in tokens)
        return type("VC", (), {"ms": ms})()

    monkeypatch.setattr(lp, "measure_verify_cost", fake_cost)
    choice = apply_linear_product(target, [drafter, None], "auto", tmp_path)
    assert choice.product == "transposed" and not choice.cached
    assert choice.torch_ms == tuple(5.0 * n for n in CHOICE_TOKENS)
    assert linear_product(target) == linear_product(drafter) == "transposed"
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["product"] == "transposed"
    assert "transposed" in choice.summary() and "torch 5/10/15/20/30/40 ms" in choice.summary()

    def fail(*a, **k):
        raise AssertionError("timed again although cached")

    monkeypatch.setattr(lp, "measure_verify_cost", fail)
    again = choose_linear_product(target, tmp_path)  # the key is taken with torch's product set
    assert again.cached and again.product == "transposed" and again.transposed_ms == choice.transposed_ms
    assert LinearProductChoice.from_dict(json.loads(json.dumps(again.to_dict()))) == again


def test_auto_times_a_real_float32_model_and_keeps_the_lower_total(tmp_path):
    target = tiny_target()
    choice = choose_linear_product(target, tmp_path)
    assert len(choice.torch_ms) == len(choice.transposed_ms) == len(CHOICE_TOKENS)
    assert all(ms > 0 for ms in choice.torch_ms + choice.transposed_ms)
    faster = "transposed" if sum(choice.transposed_ms) < sum(choice.torch_ms) else "torch"
    assert choice.product == faster and linear_product(target) == "torch"  # choose sets nothing


def test_auto_keeps_torchs_product_untimed_off_float32_cpu(tmp_path):
    target = tiny_target().to(torch.bfloat16)
    choice = apply_linear_product(target, [], "auto", tmp_path)
    assert (choice.product, choice.tokens) == ("torch", ()) and not list(tmp_path.iterdir())
    assert choice.summary() == "linear product: torch (auto: only float32 on the CPU is timed)"


def test_a_fixed_setting_is_applied_without_timing_and_bad_names_are_refused(tmp_path):
    target = tiny_target()
    assert apply_linear_product(target, [], "transposed", tmp_path).product == "transposed"
    assert linear_product(target) == "transposed" and not list(tmp_path.iterdir())
    with pytest.raises(ValueError, match="'fast'.*auto, torch, transposed"):
        apply_linear_product(target, [], "fast", tmp_path)
    with pytest.raises(ValueError, match="GenerateConfig.linear_product='fast'"):
        GenerateConfig(linear_product="fast")
    with pytest.raises(ValueError, match="BenchE2EConfig.linear_product='fast'"):
        BenchE2EConfig(drafters=(("a", "b"),), linear_product="fast")


def test_a_choice_timed_on_a_busy_machine_is_timed_again(tmp_path, monkeypatch):
    """The cache records the load before timing; one taken under load (or without a record) is redone."""
    target = tiny_target()
    calls = []

    def fake_cost(model, tokens, context):
        calls.append(linear_product(model))
        return type("VC", (), {"ms": tuple(2.0 * n for n in tokens)})()

    monkeypatch.setattr(lp, "measure_verify_cost", fake_cost)
    monkeypatch.setattr(lp, "read_competing_load", lambda: 7.5)  # two busy jobs and more beside it
    busy = choose_linear_product(target, tmp_path)
    (path,) = tmp_path.glob("*.json")
    machine = json.loads(path.read_text())["machine"]
    assert machine["busy"] and machine["load_1m"] == 7.5 and "7.50 cores before timing" in machine["reason"]
    assert not busy.cached and len(calls) == 2
    monkeypatch.setattr(lp, "read_competing_load", lambda: 0.1)  # quiet now: the busy timing is redone
    again = choose_linear_product(target, tmp_path)
    assert not again.cached and len(calls) == 4
    assert json.loads(path.read_text())["machine"]["busy"] is False
    assert choose_linear_product(target, tmp_path).cached and len(calls) == 4  # a quiet one is reused
    raw = json.loads(path.read_text())
    del raw["machine"]  # a cache written before loads were recorded
    path.write_text(json.dumps(raw))
    assert not choose_linear_product(target, tmp_path).cached and len(calls) == 6
