"""--draft auto: the verification-cost curve (measured once, cached), predicted tau per shape, the plan."""

from __future__ import annotations

import json

import pytest
import torch

from slimspec_convert.decoding.config import DraftConfig
from slimspec_convert.decoding.lookup import lookup_matches
from slimspec_convert.measure import draft_shape
from slimspec_convert.measure import verify_cost as verify_cost_module
from slimspec_convert.measure.chain_acceptance import (
    chain_acceptance,
    chain_agreement,
    chain_ranks,
    onpolicy_eval_from_ids,
    round_starts,
)
from slimspec_convert.measure.draft_shape import candidate_shapes, plan_draft_shape, predicted_tau
from slimspec_convert.measure.verify_cost import VerifyCost, verify_cost
from tests.helpers.models import tiny_drafter, tiny_target, tiny_tokenizer
from tests.unit.measure.test_chain_acceptance import AUX, V, greedy_rows


def test_verify_cost_interpolates_and_extrapolates_linearly():
    vc = VerifyCost((1, 4, 8), (10.0, 13.0, 21.0), 256)
    assert [vc.at(n) for n in (1, 2, 4, 6, 8, 12)] == [10.0, 11.0, 13.0, 17.0, 21.0, 29.0]


def test_predicted_tau_reads_top1_for_chains_and_the_per_level_width_for_trees():
    ranks = torch.tensor([[0, 0, 1, 3], [0, 2, 0, 0], [1, 0, 0, 0]])  # [depth, starts]
    chain = DraftConfig(method="chain", depth=3)
    assert predicted_tau(ranks, chain) == pytest.approx(1 + (2 + 1 + 0) / 4)
    tree = DraftConfig(method="tree", depth=3, top_k=4, total_tokens=9)  # 3 per level: ranks < 3
    assert predicted_tau(ranks, tree) == pytest.approx(1 + (3 + 3 + 3) / 4)


def test_predicted_tau_with_starts_averages_the_rounds_decoding_visits():
    ranks = torch.tensor([[0, 0, 1, 0, 5], [0, 1, 0, 0, 0]])  # [depth, starts]: accepts 2, 1, 0, 2, 0
    starts = torch.tensor([[0, 3], [0, 4], [0, 5], [0, 6], [0, 7]])
    chain = DraftConfig(method="chain", depth=2)
    assert predicted_tau(ranks, chain) == pytest.approx(1 + 5 / 5)  # every start
    assert predicted_tau(ranks, chain, starts) == pytest.approx(1 + (2 + 2) / 2)  # t = 3, then t = 6


def _drafter_and_answers():
    """A tiny drafter and the tiny target's greedy answers to four random prompts (on-policy set)."""
    target = tiny_target(seed=3, vocab_size=V)
    drafter = tiny_drafter(seed=1, vocab_size=V, draft_vocab_size=V)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, V, (n,), generator=g).tolist() for n in (5, 9, 4, 7)]
    return drafter, onpolicy_eval_from_ids(target, greedy_rows(target, prompts), AUX)


def test_chain_ranks_agree_with_chain_agreement_and_chain_acceptance():
    drafter, ev = _drafter_and_answers()
    ranks = chain_ranks(drafter, ev, 3)
    agree, _ = chain_agreement(drafter, ev, 3)
    assert torch.equal(ranks == 0, agree)
    assert bool((ranks > 0).any()) and bool((ranks == 0).any())  # guard: both kinds of rounds
    expect = chain_acceptance(drafter, ev, 3).predicted_tau
    assert predicted_tau(ranks, DraftConfig(method="chain", depth=3)) == pytest.approx(expect)


def test_the_verification_curve_is_measured_once_and_the_plan_picks_its_best_candidate(tmp_path, monkeypatch):
    monkeypatch.setattr(
        verify_cost_module, "read_competing_load", lambda: 0.0
    )  # quiet: a busy timing is not reused
    monkeypatch.setattr(draft_shape, "read_competing_load", lambda: 0.0)
    target, tok = tiny_target(), tiny_tokenizer()
    drafter = tiny_drafter(seed=1)
    first = verify_cost(target, tmp_path, context=64)
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["tokens"][0] == 1
    assert all(ms > 0 for ms in first.ms) and first.key["context"] == 64
    prompts = ["hello there", "two plus two"]
    plan = plan_draft_shape(
        target, tok, drafter, prompts, max_new_tokens=12, cost_tokens=6, cache_dir=tmp_path, cache=False
    )

    def fail(*a, **k):
        raise AssertionError("measured again although cached")

    monkeypatch.setattr(verify_cost_module, "measure_verify_cost", fail)
    assert verify_cost(target, tmp_path, context=64) == first
    again = plan_draft_shape(
        target, tok, drafter, prompts, max_new_tokens=12, cost_tokens=6, cache_dir=tmp_path, cache=False
    )
    assert again.verify == plan.verify and plan.verify.context % 64 == 0
    tps = [c.predicted_tokens_per_s for c in plan.candidates]
    assert tps == sorted(tps, reverse=True)
    assert len(tps) == len(candidate_shapes(drafter.config.draft_vocab_size))
    assert plan.best.shape in plan.summary() and plan.draft.depth == plan.best.draft["depth"]
    best = plan.candidates[0]
    round_s = (best.verify_ms + best.draft_and_loop_ms) / 1e3
    assert best.predicted_tokens_per_s == pytest.approx(best.predicted_tau / round_s)
    with pytest.raises(ValueError, match="other prompts"):
        ev = draft_shape.build_onpolicy_eval(target, tok, prompts, AUX, max_new_tokens=12)
        plan_draft_shape(
            target, tok, drafter, prompts[:1], max_new_tokens=12, cache_dir=tmp_path, ev=ev, cache=False
        )


def test_bench_e2e_with_auto_shapes_stays_lossless_and_reports_each_plan(tmp_path, monkeypatch):
    from slimspec_convert.measure.e2e import BenchE2EConfig, run_e2e
    from slimspec_convert.targets.fetch import cache_dir

    monkeypatch.setenv("SLIMSPEC_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path
    target, tok = tiny_target(), tiny_tokenizer()
    drafters = {"a": tiny_drafter(seed=1), "b": tiny_drafter(seed=2)}
    prompts = ["hello there", "two plus two", "a cat sat"]
    held_out = tmp_path / "held-out.jsonl"
    held_out.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["one two", "three four"]))
    cfg = BenchE2EConfig(
        drafters=(("a", "-"), ("b", "-")),
        draft_method="auto",
        max_new_tokens=10,
        warmup_tokens=0,
        auto_prompts=str(held_out),
        lookup=0,
    )
    from slimspec_convert.measure import e2e

    built = []
    real_build = e2e.build_onpolicy_eval
    monkeypatch.setattr(e2e, "build_onpolicy_eval", lambda *a, **k: built.append(a[2]) or real_build(*a, **k))
    res = run_e2e(target, tok, drafters, prompts, cfg)
    assert built == [["one two", "three four"]]  # the held-out prompts, answered once for both drafters
    rows = {r.name: r for r in res.rows}
    plans = res.config["auto_plans"]
    assert set(plans) == {"a", "b"} and len(list((tmp_path / "verify_cost").glob("*.json"))) == 1
    for name in ("a", "b"):
        assert rows[name].lossless is True
        assert rows[name].shape == plans[name]["shape"]
        assert rows[name].predicted_tokens_per_s == plans[name]["predicted_tokens_per_s"] > 0
    assert rows["none"].shape is None and rows["none"].predicted_tokens_per_s is None


def test_auto_draft_without_a_drafter_is_plain_decoding_and_refuses_a_sampled_lookup():
    from slimspec_convert.decoding.config import SamplingConfig
    from slimspec_convert.workflows.generate import auto_draft

    target, tok = tiny_target(), tiny_tokenizer()
    assert auto_draft(target, tok, None, SamplingConfig()) == DraftConfig()  # nothing to plan
    assert auto_draft(target, tok, None, SamplingConfig(), lookup=2).lookup == 2  # lookup alone
    with pytest.raises(ValueError, match="a sampled chain cannot take the lookup branch; give --draft tree"):
        auto_draft(target, tok, tiny_drafter(), SamplingConfig(temperature=0.7), lookup=3)


def test_calibration_prompts_are_spread_over_the_held_out_file():
    prompts = draft_shape.calibration_prompts()
    lines = [json.loads(x)["prompt"] for x in draft_shape.HELDOUT_PROMPTS.read_text().splitlines()]
    assert draft_shape.HELDOUT_PROMPTS.parts[-3:] == ("data", "heldout", "general24.jsonl")
    assert prompts == [lines[0], lines[8], lines[15], lines[23]]  # round(i * 23 / 3), i = 0..3
    with pytest.raises(ValueError, match="num=0"):
        draft_shape.calibration_prompts(num=0)


def test_round_starts_are_chain_agreements_columns_and_lookup_matches_reads_the_text():
    drafter, ev = _drafter_and_answers()
    _, starts = chain_agreement(drafter, ev, 3)
    assert torch.equal(round_starts(ev, 3), starts)
    text = [7, 1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 9]
    # root 5 (token 1): (4, 1) never occurred; alone, 1 occurred at 1 -> [2, 3, 4] against 2, 3, 5
    # root 6 (token 2): (1, 2) ended at 2 -> [3, 4, 1] against 3, 5
    # root 9 (token 1): (5, 1) never occurred; alone, 1 last occurred at 5 -> [2, 3, 5] against 2, 9
    assert lookup_matches(text, [5, 6, 9], 12, 3, 2, 3) == [(0, 0), (3, 1), (0, 0)]
    assert lookup_matches(text, [5, 6, 9], 12, 3, 1, 3) == [(3, 2), (3, 1), (3, 1)]
    assert lookup_matches(text, [9], 10, 3, 1, 3) == [(3, 0)]  # the text ends at 10: nothing to match


def test_the_plan_with_lookup_carries_it_on_every_candidate_and_predicts_no_less(tmp_path):
    target, tok = tiny_target(), tiny_tokenizer()
    drafter = tiny_drafter(seed=1)
    prompts = ["a b a b a b", "c d c d c d"]
    kw = dict(max_new_tokens=16, cost_tokens=6, cache_dir=tmp_path)
    plain = plan_draft_shape(target, tok, drafter, prompts, **kw)
    look = plan_draft_shape(
        target, tok, drafter, prompts, **kw, lookup=DraftConfig(lookup=3, lookup_min_ngram=1)
    )
    assert all(c.draft["lookup"] == 3 and c.shape.endswith("+lookup-3") for c in look.candidates)
    assert look.draft.lookup == 3 and look.draft.lookup_min_ngram == 1
    before = {c.shape: c.predicted_tau for c in plain.candidates}
    after = {c.shape.removesuffix("+lookup-3"): c.predicted_tau for c in look.candidates}
    assert before.keys() == after.keys()
    assert all(after[s] >= before[s] for s in before)
    assert any(after[s] > before[s] for s in before)  # guard: the lookup was right somewhere


def test_the_plan_chooses_the_lookup_and_times_its_winner_with_it(tmp_path):
    target, tok = tiny_target(), tiny_tokenizer()
    drafter = tiny_drafter(seed=1)
    prompts = ["a b a b a b", "c d c d c d"]
    kw = dict(max_new_tokens=16, cost_tokens=6, cache_dir=tmp_path, cache=False)
    plain = plan_draft_shape(target, tok, drafter, prompts, **kw)
    grams = DraftConfig(lookup_min_ngram=1)
    both = plan_draft_shape(target, tok, drafter, prompts, **kw, lookup=grams, lookups=(0, 1, 3))
    shapes = [c.shape for c in plain.candidates]
    assert sorted(c.shape for c in both.candidates) == sorted(
        s + suffix for s in shapes for suffix in ("", "+lookup-1", "+lookup-3")
    )
    tau = {c.shape: c.predicted_tau for c in both.candidates}
    assert all(
        tau[s] == pytest.approx(c.predicted_tau) for s, c in zip(shapes, plain.candidates, strict=True)
    )
    assert all(tau[s + "+lookup-3"] >= tau[s] for s in shapes)
    assert any(tau[s + "+lookup-3"] > tau[s] for s in shapes)  # guard: the lookup was right somewhere
    assert both.best.timed and all(c.timed for c in both.candidates if "+lookup" not in c.shape)
    assert both.draft == DraftConfig(**both.best.draft) and both.draft.lookup_min_ngram == 1
    # The final round: the best predicted without and with the lookup decoded the calibration prompts;
    # the faster of the two leads, the rest follow in predicted order.
    final, rest = both.candidates[:2], both.candidates[2:]
    assert [bool(c.draft["lookup"]) for c in final] in ([False, True], [True, False])
    assert final[0].measured_tokens_per_s >= final[1].measured_tokens_per_s > 0
    assert all(c.measured_tokens_per_s is None for c in rest)
    for lookup in (False, True):  # each finalist was its group's best prediction
        group = [c.predicted_tokens_per_s for c in both.candidates if bool(c.draft["lookup"]) == lookup]
        finalist = next(c for c in final if bool(c.draft["lookup"]) == lookup)
        assert finalist.timed and finalist.predicted_tokens_per_s == max(group)
    tps = [c.predicted_tokens_per_s for c in rest]
    assert tps == sorted(tps, reverse=True)
    assert "measured on the calibration prompts" in both.summary()
    with pytest.raises(ValueError, match="lookups=\\(-1,\\)"):
        plan_draft_shape(target, tok, drafter, prompts, **kw, lookups=(-1,))


def test_a_plan_is_cached_per_drafter_and_not_reused_from_a_busy_machine(tmp_path, monkeypatch):
    target, tok = tiny_target(), tiny_tokenizer()
    drafter = tiny_drafter(seed=1)
    prompts = ["hello there", "two plus two"]
    kw = dict(max_new_tokens=12, cost_tokens=6, cache_dir=tmp_path, lookups=(0, 2))
    monkeypatch.setattr(draft_shape, "read_competing_load", lambda: 0.0)  # quiet
    first = plan_draft_shape(target, tok, drafter, prompts, **kw)
    assert not first.cached and len(list((tmp_path / "draft_plan").glob("*.json"))) == 1

    def fail():
        raise AssertionError("the target answered again although the plan was cached")

    again = plan_draft_shape(target, tok, drafter, prompts, **kw, ev=fail)
    assert again.cached and again.draft == first.draft and again.candidates == first.candidates
    assert again.planned_seconds == first.seconds and "cached plan" in again.summary()
    other = tiny_drafter(seed=2)  # other weights: another key
    assert draft_shape.drafter_fingerprint(other) != draft_shape.drafter_fingerprint(drafter)
    with pytest.raises(AssertionError, match="answered again"):
        plan_draft_shape(target, tok, other, prompts, **kw, ev=fail)
    monkeypatch.setattr(draft_shape, "read_competing_load", lambda: 99.0)  # the next plan is made under load
    busy = plan_draft_shape(
        target, tok, drafter, prompts, **kw, cache=True, lookup=DraftConfig(lookup_max_ngram=2)
    )
    assert not busy.cached
    with pytest.raises(AssertionError, match="answered again"):  # a busy plan is made again
        plan_draft_shape(target, tok, drafter, prompts, **kw, lookup=DraftConfig(lookup_max_ngram=2), ev=fail)
