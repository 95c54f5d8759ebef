"""bench e2e on tiny models: lossless outputs, tau recomputed from per-prompt stats, cost-model wiring."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from typer.testing import CliRunner

import slimspec_convert.measure.e2e as e2e
import slimspec_convert.measure.machine as machine
import slimspec_convert.workflows.bench as bench_workflow
from slimspec_convert.checkpoint.save import save_drafter
from slimspec_convert.cli.app import app
from slimspec_convert.lowrank.costmodel import predicted_speedup
from slimspec_convert.lowrank.svd import lowrank_factorize
from slimspec_convert.measure.e2e import head_kind
from slimspec_convert.measure.plots import plot_predicted_vs_measured
from slimspec_convert.measure.tables import e2e_markdown
from slimspec_convert.model.drafter import Eagle3Drafter
from slimspec_convert.workflows.trim import trim_drafter
from tests.helpers.models import tiny_drafter, tiny_target
from tests.helpers.wordlevel import save_tiny_target_folder


def _lowrank_copy(drafter: Eagle3Drafter, rank: int, head_is_embedding: bool | None = None) -> Eagle3Drafter:
    fac = lowrank_factorize(drafter.lm_head.weight.detach(), rank)
    low = Eagle3Drafter(drafter.config.replace(head_rank=rank, head_is_embedding=head_is_embedding))
    state = {k: v for k, v in drafter.state_dict().items() if k != "lm_head.weight"}
    state.update({"lm_head.up.weight": fac.W_up, "lm_head.down.weight": fac.W_down})
    low.load_state_dict(state, strict=True)
    return low.eval()


def test_head_kind():
    full = tiny_drafter()
    assert [head_kind(None), head_kind(full), head_kind(_lowrank_copy(full, 8))] == [
        "plain",
        "full",
        "lowrank",
    ]
    assert head_kind(tiny_drafter(draft_vocab_size=64)) == "trimmed"


def test_cli_bench_e2e(tmp_path, monkeypatch):
    target = save_tiny_target_folder(tmp_path / "target", tiny_target(), ["a", "b", "c", "d", "e", "f"])
    full = tiny_drafter()
    paths = {"full": tmp_path / "full", "low": tmp_path / "low", "trim": tmp_path / "trim"}
    save_drafter(full, paths["full"], include_embeddings=True)
    save_drafter(_lowrank_copy(full, 8), paths["low"], include_embeddings=True)
    save_drafter(trim_drafter(full, torch.arange(128), 64), paths["trim"], include_embeddings=True)
    tied = tiny_drafter(seed=1)  # its lm_head is its embedding table: what the rerank's rows assume
    with torch.no_grad():
        tied.lm_head.weight.copy_(tied.embed_tokens.weight)
    save_drafter(
        _lowrank_copy(tied, 8, head_is_embedding=True), tmp_path / "tied-low", include_embeddings=True
    )
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "a b c"}\n{"turns": ["d e f a", "ignored second turn"]}\n')
    args = [
        "bench",
        "e2e",
        "--target",
        str(target),
        "--prompts",
        str(prompts),
        "--out",
        str(tmp_path / "out"),
        "--max-new-tokens",
        "6",
        "--draft",
        "chain",
        "--linear-product",
        "transposed",
        "--json",
    ]
    for name, path in paths.items():
        args += ["--drafter", f"{name}={path}"]
    monkeypatch.setattr(e2e, "read_load_1m", lambda: 1000.0)  # a machine far busier than its cores
    monkeypatch.setattr(e2e, "read_competing_load", lambda: 999.0)  # ... because of other processes
    monkeypatch.setattr(machine, "usable_cores", lambda: 2)
    plotted = {}

    def plot(*a, **kw):
        plotted.update(kw, names=a[0])
        return plot_predicted_vs_measured(*a, **kw)

    monkeypatch.setattr(bench_workflow, "plot_predicted_vs_measured", plot)
    args += ["--drafter", f"lowrr={tmp_path / 'tied-low'}", "--rerank", "lowrr=16", "--rerank-context", "32"]
    monkeypatch.setattr(sys, "argv", ["/venv/bin/slimspec", *args])  # what a shell would pass
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    rows = {r["name"]: r for r in summary["rows"]}
    assert list(rows) == ["none", "full", "low", "trim", "lowrr"]
    assert [rows[n]["kind"] for n in rows] == ["plain", "full", "lowrank", "trimmed", "lowrank"]
    assert (rows["low"]["rerank_k"], rows["lowrr"]["rerank_k"]) == (0, 16)
    assert (rows["low"]["rerank_context"], rows["lowrr"]["rerank_context"]) == (0, 32)
    assert (rows["low"]["rank"], rows["trim"]["draft_vocab_size"]) == (8, 64)
    assert summary["reference"] == "full" and summary["num_prompts"] == 2
    assert summary["config"]["run_on"] == {
        "device": "cpu",
        "dtype": "float32",
    }  # --dtype/--device auto on a CPU
    assert summary["linear_product"]["product"] == "transposed"  # on the target and every drafter
    # Greedy speculative decoding is lossless: every drafter reproduces plain decoding token for token.
    assert [rows[n]["lossless"] for n in ("full", "low", "trim", "lowrr")] == [True] * 4
    full_json = json.loads((tmp_path / "out" / "e2e.json").read_text())
    made = full_json["provenance"]  # what scripts/make_docs.py cites
    assert made["command"].startswith("slimspec bench e2e --target") and "--draft chain" in made["command"]
    assert (
        made["target"] == str(target)
        and made["prompts"] == f"the first 2 of {prompts}; draft shapes planned on none"
    )
    assert made["versions"]["torch"] == torch.__version__ and made["job"] is None
    plain_ids = [p["output_ids"] for p in full_json["per_prompt"]["none"]]
    for name in ("full", "low", "trim", "lowrr"):
        assert [p["output_ids"] for p in full_json["per_prompt"][name]] == plain_ids
        # tau = committed tokens / verification rounds, recomputed from the raw per-prompt stats.
        per = full_json["per_prompt"][name]
        tau = sum(sum(p["committed_per_cycle"]) for p in per) / sum(p["cycles"] for p in per)
        assert rows[name]["tau"] == pytest.approx(tau)
        assert 1.0 <= tau <= 6.0  # chain depth 5: k + 1 at most
    assert rows["none"]["tau"] == 1.0  # plain decoding commits exactly one token per target forward
    ref = rows["full"]
    assert summary["kappa"] == pytest.approx(ref["head_ms"] / (ref["wall_ms"] - ref["head_ms"]))
    assert (ref["nu"], ref["rho_tau"], ref["measured_rho_tps"]) == (1.0, 1.0, 1.0)
    low = rows["low"]
    assert low["rho_tau"] == pytest.approx(low["tau"] / ref["tau"])
    assert low["predicted_rho_tps"] == pytest.approx(
        predicted_speedup(low["rho_tau"], low["nu"], summary["kappa"])
    )
    assert low["measured_rho_tps"] == pytest.approx(low["tokens_per_s"] / ref["tokens_per_s"])
    assert (tmp_path / "out" / "e2e_speedup.png").read_bytes()[:4] == b"\x89PNG"
    # the plot shows every row against plain decoding (plain = 1.0), beside the cost-model panel
    assert plotted["speedup_names"] == ["none", "full", "low", "trim", "lowrr"]
    assert plotted["speedup_vs_plain"] == [rows[n]["speedup"] for n in plotted["speedup_names"]]
    assert plotted["speedup_vs_plain"][0] == 1.0 and plotted["names"] == ["full", "low", "trim", "lowrr"]
    assert summary["machine"] == {
        "load_1m": 1000.0,
        "cpu_count": 2,
        "timing_spread": None,
        "busy": True,
        "reason": "other processes busy on 999.00 cores + 1 threads > 2 cores + 0.5",
    }
    assert (
        "warning: busy machine (other processes busy on 999.00 cores + 1 threads > 2 cores + 0.5)"
        in res.stderr
    )
    md = (tmp_path / "out" / "e2e.md").read_text()
    assert "| low | lowrank r=8 V_d=128 | chain-5 |" in md
    assert "| lowrr | lowrank r=8 +rerank k=16 ctx=32 V_d=128 | chain-5 |" in md
    assert "batch 1, draft chain, cpu float32." in md
    assert "Target and drafters, linear product: transposed (as asked)." in md
    assert "Machine: 1-min load average 1000.00 on 2 cores; BUSY (other processes busy on 999.00 cores" in md
    bad = CliRunner().invoke(app, args + ["--drafter", "none=" + str(paths["full"])])
    assert bad.exit_code == 2 and "'none' is the plain-decoding baseline" in bad.output
    bad = CliRunner().invoke(app, args + ["--force", "--rerank", "nope=4"])
    assert bad.exit_code == 2 and "rerank: 'nope' is not one of the drafters" in bad.output
    bad = CliRunner().invoke(app, args + ["--force", "--rerank", "low=many"])
    assert bad.exit_code == 2 and "--rerank 'low=many': expected NAME=K with an integer K" in bad.output
    bad = CliRunner().invoke(app, args + ["--force", "--rerank", "full=4"])
    assert bad.exit_code == 2 and "--rerank full=4" in bad.output and "needs a low-rank lm_head" in bad.output
    bad = CliRunner().invoke(app, args + ["--force", "--rerank", "low=4"])  # a random head, not the embedding
    assert bad.exit_code == 2 and "--rerank low=4" in bad.output and "head_is_embedding unset" in bad.output


def test_e2e_plot_draws_speed_relative_to_plain_decoding_for_every_row(tmp_path, monkeypatch):
    """Bar heights of both panels, read back from the figure (main job numbers, README table)."""
    import slimspec_convert.measure.plots as plots

    figures = []
    monkeypatch.setattr(plots, "_save", lambda plt, fig, path: figures.append(fig) or path)
    names = ["none", "full", "trim16k", "slimspec", "slimspec-rerank"]
    speedups = [1.0, 0.429, 0.557, 0.569, 0.621]
    plot_predicted_vs_measured(
        names[1:],
        [1.0, 1.284, 1.276, 1.382],
        [1.0, 1.299, 1.325, 1.446],
        tmp_path / "p.png",
        speedup_names=names,
        speedup_vs_plain=speedups,
    )
    left, right = figures[0].axes
    assert [b.get_height() for b in left.patches] == speedups
    assert [t.get_text() for t in left.get_xticklabels()] == names
    assert left.get_ylabel() == "tokens/s relative to plain decoding"
    assert [b.get_height() for b in right.patches] == [1.0, 1.284, 1.276, 1.382, 1.0, 1.299, 1.325, 1.446]
    with pytest.raises(ValueError, match="speedup_names has 2 entries, speedup_vs_plain 1"):
        plot_predicted_vs_measured(
            [], [], [], tmp_path / "q.png", speedup_names=["a", "b"], speedup_vs_plain=[1.0]
        )


@pytest.mark.parametrize("slow_first", [True, False])
def test_e2e_repeats_keep_each_configurations_fastest_run_and_count_tokens_once(monkeypatch, slow_first):
    """--repeats 2: every (batch, configuration) runs twice, interleaved; the faster wall time is kept."""
    from types import SimpleNamespace

    from slimspec_convert.measure.e2e import BenchE2EConfig, run_e2e
    from tests.helpers.models import tiny_tokenizer

    target, tok = tiny_target(), tiny_tokenizer()
    drafters = {"full": tiny_drafter(seed=1), "low": _lowrank_copy(tiny_drafter(seed=1), 8)}
    prompts = ["hello there", "two plus two", "a cat sat"]
    base = dict(drafters=(("full", "-"), ("low", "-")), draft_method="chain", max_new_tokens=8)
    once = run_e2e(target, tok, drafters, prompts, BenchE2EConfig(**base, warmup_tokens=0))
    # A fake clock read only by run_e2e (two reads per decode): within each batch the first round of
    # the three configurations takes 1 s a decode and the second 0.25 s, or the other way round.
    slow, fast = (1.0, 0.25) if slow_first else (0.25, 1.0)
    clock = {"t": 0.0, "reads": 0}

    def perf_counter():
        k, end = divmod(clock["reads"], 2)  # the k-th decode: its start, then its end
        clock["reads"] += 1
        if end:
            clock["t"] += slow if (k // 3) % 2 == 0 else fast  # 3 configurations a round
        return clock["t"]

    monkeypatch.setattr(e2e, "time", SimpleNamespace(perf_counter=perf_counter))
    twice = run_e2e(target, tok, drafters, prompts, BenchE2EConfig(**base, warmup_tokens=0, repeats=2))
    assert clock["reads"] == 2 * 3 * 2 * len(prompts)  # 2 reads, 3 configurations, 2 rounds
    rows_once, rows_twice = {r.name: r for r in once.rows}, {r.name: r for r in twice.rows}
    for name in ("none", "full", "low"):
        assert rows_twice[name].wall_ms == pytest.approx(0.25e3 * len(prompts))  # the faster of the two
        # tokens, rounds and tau are counted once per prompt, as with a single run
        r1, r2 = rows_once[name], rows_twice[name]
        assert (r2.new_tokens, r2.rounds, r2.tau) == (r1.new_tokens, r1.rounds, r1.tau)
        assert r2.tokens_per_s == pytest.approx(r2.new_tokens / (0.25 * len(prompts)))
    assert rows_twice["full"].lossless and rows_twice["low"].lossless
    assert twice.config["repeats"] == 2
    with pytest.raises(ValueError, match=r"BenchE2EConfig.repeats=0: must be >= 1"):
        BenchE2EConfig(**base, repeats=0)


def test_e2e_repeat_decoding_other_tokens_is_a_mismatch(monkeypatch):
    """A configuration whose second run decodes other tokens than its first is not lossless."""
    from slimspec_convert.measure.e2e import BenchE2EConfig, run_e2e
    from tests.helpers.models import tiny_tokenizer

    calls = {"n": 0}
    real = e2e.SpeculativeGenerator.generate

    def flaky(self, batch):
        out = real(self, batch)
        if self.drafter is not None:
            calls["n"] += 1
            if calls["n"] == 2:  # the drafter's second run of the first prompt
                out[0].output_ids = out[0].output_ids[:-1] + [out[0].output_ids[-1] + 1]
        return out

    monkeypatch.setattr(e2e.SpeculativeGenerator, "generate", flaky)
    cfg = BenchE2EConfig(
        drafters=(("full", "-"),), draft_method="chain", max_new_tokens=6, repeats=2, warmup_tokens=0
    )
    res = run_e2e(tiny_target(), tiny_tokenizer(), {"full": tiny_drafter(seed=1)}, ["a b", "c d"], cfg)
    row = next(r for r in res.rows if r.name == "full")
    assert (row.lossless, row.num_mismatched_prompts) == (False, 1)


def test_e2e_lookup_grafts_onto_every_drafter_and_adds_a_lookup_row():
    """--lookup 3: every drafter's shape carries it, a drafter-less 'lookup' row is added, all lossless."""
    from slimspec_convert.measure.e2e import BenchE2EConfig, run_e2e
    from tests.helpers.models import tiny_tokenizer

    cfg = BenchE2EConfig(
        drafters=(("full", "-"),), draft_method="chain", max_new_tokens=24, warmup_tokens=0, lookup=3
    )
    prompts = ["a b a b a b", "c d c d"]
    res = run_e2e(tiny_target(), tiny_tokenizer(), {"full": tiny_drafter(seed=1)}, prompts, cfg)
    rows = {r.name: r for r in res.rows}
    assert list(rows) == ["none", "lookup", "full"]
    assert (rows["lookup"].kind, rows["lookup"].shape, rows["full"].shape) == (
        "lookup",
        "lookup-3",
        "chain-5+lookup-3",
    )
    assert rows["lookup"].lossless and rows["full"].lossless
    assert res.config["draft"]["full"]["lookup"] == 3
    for name in ("lookup", "full"):  # the row's lookup-only drafts come from its prompts' stats
        assert rows[name].lookup_tokens == sum(p["lookup_tokens"] for p in res.per_prompt[name])
    with pytest.raises(ValueError, match="'lookup' is the prompt-lookup row"):
        BenchE2EConfig(drafters=(("lookup", "-"),), lookup=3)
    with pytest.raises(ValueError, match="lookup_min_ngram=4"):
        BenchE2EConfig(drafters=(("full", "-"),), lookup=3, lookup_min_ngram=4)


def test_e2e_drafter_lookup_sets_one_drafters_lookup_and_the_lookup_row_takes_the_largest():
    """--drafter-lookup full3=3: the same drafter twice, without and with the lookup, one interleaved run."""
    from slimspec_convert.measure.e2e import BenchE2EConfig, run_e2e
    from tests.helpers.models import tiny_tokenizer

    base = dict(drafters=(("full", "-"), ("full3", "-")), draft_method="chain", max_new_tokens=16)
    cfg = BenchE2EConfig(**base, warmup_tokens=0, drafter_lookup=(("full3", 3),))
    d = tiny_drafter(seed=1)
    res = run_e2e(tiny_target(), tiny_tokenizer(), {"full": d, "full3": d}, ["a b a b a b", "c d c d"], cfg)
    rows = {r.name: r for r in res.rows}
    assert list(rows) == ["none", "lookup", "full", "full3"]
    assert (rows["full"].shape, rows["full3"].shape, rows["lookup"].shape) == (
        "chain-5",
        "chain-5+lookup-3",
        "lookup-3",
    )
    assert all(rows[n].lossless for n in ("lookup", "full", "full3"))
    assert rows["full"].lookup_tokens == 0 and res.config["drafter_lookup"] == (("full3", 3),)
    with pytest.raises(ValueError, match="drafter_lookup: 'other' is not one of the drafters"):
        BenchE2EConfig(**base, drafter_lookup=(("other", 3),))
    with pytest.raises(ValueError, match=r"BenchE2EConfig.lookup=-1: expected >= 0"):
        BenchE2EConfig(**base, lookup=-1)


def test_by_kind_sums_each_kinds_prompts_and_compares_them_with_plain_decoding():
    from slimspec_convert.measure.kinds import by_kind

    def stat(out, new, wall, committed):
        return {
            "output_ids": out,
            "new_tokens": new,
            "wall_ms": wall,
            "committed_per_cycle": committed,
            "cycles": len(committed),
        }

    per_prompt = {
        "none": [stat([1, 2], 8, 1000.0, []), stat([3], 4, 500.0, []), stat([5], 6, 1000.0, [])],
        "full": [stat([1, 2], 8, 500.0, [3, 3, 1]), stat([3], 4, 500.0, [2, 1]), stat([6], 6, 250.0, [6])],
    }
    table = by_kind(per_prompt, ["code", None, "code"])
    assert list(table) == ["code", "-"]
    plain, full = table["code"]
    assert (plain["prompts"], plain["new_tokens"], plain["wall_ms"]) == (2, 14, 2000.0)
    assert plain["tokens_per_s"] == pytest.approx(7.0) and plain["speedup"] == pytest.approx(1.0)
    assert plain["tau"] is None and plain["lossless"] is None
    assert full["tokens_per_s"] == pytest.approx(14 / 0.75) and full["speedup"] == pytest.approx(
        14 / 0.75 / 7.0
    )
    assert full["tau"] == pytest.approx(13 / 4) and full["lossless"] is False  # prompt 3 differs
    assert table["-"][1]["lossless"] is True and table["-"][1]["tau"] == pytest.approx(1.5)
    with pytest.raises(ValueError, match="by_kind: 2 kinds for 3 prompts"):
        by_kind(per_prompt, ["code", "math"])


def test_e2e_with_kinds_reports_each_kind_and_its_rows_add_up_to_the_run():
    from slimspec_convert.measure.e2e import BenchE2EConfig, run_e2e
    from tests.helpers.models import tiny_tokenizer

    target, tok = tiny_target(), tiny_tokenizer()
    drafters = {"full": tiny_drafter(seed=1), "low": _lowrank_copy(tiny_drafter(seed=1), 8)}
    prompts, kinds = ["hello there", "two plus two", "a cat sat"], ["prose", "math", "prose"]
    cfg = BenchE2EConfig(drafters=(("full", "-"), ("low", "-")), draft_method="chain", max_new_tokens=8)
    res = run_e2e(target, tok, drafters, prompts, cfg, kinds=kinds)
    assert list(res.by_kind) == ["prose", "math"]
    rows = {r.name: r for r in res.rows}
    for name, row in rows.items():
        parts = [next(r for r in res.by_kind[k] if r["name"] == name) for k in res.by_kind]
        assert [p["prompts"] for p in parts] == [2, 1]
        assert sum(p["new_tokens"] for p in parts) == row.new_tokens
        assert all(p["lossless"] is (None if name == "none" else True) for p in parts)
    assert run_e2e(target, tok, drafters, prompts, cfg).by_kind is None  # no kinds, no table
    md = e2e_markdown(res)
    assert "Per kind of prompt" in md and "- prose (2 prompts): none " in md and "- math (1 prompts): " in md


def test_prompt_kinds_reads_the_kind_field(tmp_path):
    from slimspec_convert.decoding.prompts import prompt_kinds

    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a", "kind": "code"}\n\n{"turns": ["b"]}\n{"prompt": "c", "kind": 3}\n')
    assert prompt_kinds(path) == ["code", None, None]
    with pytest.raises(FileNotFoundError):
        prompt_kinds(tmp_path / "missing.jsonl")


def test_e2e_depth_fixes_every_drafters_chain_and_lookup_row_adds_prompt_lookup_alone():
    from slimspec_convert.measure.e2e import BenchE2EConfig, run_e2e
    from tests.helpers.models import tiny_tokenizer

    target, tok = tiny_target(), tiny_tokenizer()
    drafters = {"full": tiny_drafter(seed=1), "low": _lowrank_copy(tiny_drafter(seed=1), 8)}
    cfg = BenchE2EConfig(
        drafters=(("full", "-"), ("low", "-")), draft_method="chain", depth=2, lookup_row=3, max_new_tokens=8
    )
    res = run_e2e(target, tok, drafters, ["hello there", "a cat sat"], cfg)
    rows = {r.name: r for r in res.rows}
    assert list(rows) == ["none", "lookup", "full", "low"]
    assert rows["full"].shape == rows["low"].shape == "chain-2" and rows["lookup"].shape == "lookup-3"
    assert all(rows[n].lossless for n in ("lookup", "full", "low"))
    assert rows["low"].predicted_rho_tps is not None  # one shape for all: the cost model applies
    with pytest.raises(ValueError, match=r"BenchE2EConfig.depth=0: expected >= 1"):
        BenchE2EConfig(drafters=(("full", "-"),), depth=0)
