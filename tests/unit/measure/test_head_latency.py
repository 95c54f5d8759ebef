"""Timing harness logic (fake clock: no timed assertions), rank parsing, ideal ratios, bench CLI."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

import slimspec_convert.measure.timing as timing
from slimspec_convert.cli.app import app
from slimspec_convert.measure.head_latency import (
    BenchHeadConfig,
    bench_head,
    ideal_speedup,
    resolve_ranks,
)
from slimspec_convert.measure.timing import time_interleaved
from slimspec_convert.model.head import LowRankHead
from slimspec_convert.workflows.bench import head_shape_from_config
from tests.helpers.models import tiny_drafter


class FakeClock:
    """perf_counter / perf_counter_ns that only move when a timed callable advances them."""

    def __init__(self):
        self.ns = 0

    def perf_counter_ns(self):
        return self.ns

    def perf_counter(self):
        return self.ns / 1e9

    def advance_ms(self, ms):
        self.ns += int(ms * 1e6)


@pytest.fixture()
def clock(monkeypatch):
    c = FakeClock()
    monkeypatch.setattr(timing, "time", c)
    return c


def test_interleaved_order_and_medians(clock):
    calls = []
    costs = {"a": [1, 1, 9, 1, 1], "b": [3, 3, 3, 3, 4], "c": [2, 2, 2, 2, 2]}  # ms per call, in call order

    def make(name):
        def fn():
            calls.append(name)
            clock.advance_ms(costs[name][sum(c == name for c in calls) - 1])

        return fn

    t = time_interleaved({n: make(n) for n in "abc"}, warmup=1, repeats=4, min_repeats=1)
    # One warm-up round, then round i starts at key i mod 3.
    assert "".join(calls) == "abc" + "abc" + "bca" + "cab" + "abc"
    assert t["a"].samples_ms == (1.0, 9.0, 1.0, 1.0)  # round order: a's 2nd..5th calls
    assert t["a"].median_ms == 1.0  # the 9 ms outlier does not move the median
    assert t["b"].median_ms == 3.0 and t["c"].median_ms == 2.0


def test_budget_caps_rounds(clock):
    fns = {"x": lambda: clock.advance_ms(4.0), "y": lambda: clock.advance_ms(6.0)}  # 10 ms per round
    assert len(time_interleaved(fns, repeats=50, min_repeats=3, budget_s=0.05)["x"].samples_ms) == 5
    assert len(time_interleaved(fns, repeats=50, min_repeats=3, budget_s=0.001)["x"].samples_ms) == 3
    assert len(time_interleaved(fns, repeats=4, min_repeats=3, budget_s=10.0)["x"].samples_ms) == 4
    with pytest.raises(ValueError, match="no callables"):
        time_interleaved({})


def test_resolve_ranks_and_ideal_ratio():
    assert resolve_ranks(["d/8", "d/16", 512], 4096) == (512, 256)
    assert resolve_ranks(["72"], 576) == (72,)
    with pytest.raises(ValueError, match="rank r=0"):
        resolve_ranks(["d/8192"], 4096)
    with pytest.raises(ValueError, match="expected an integer or d/N"):
        resolve_ranks(["d8"], 4096)
    # Llama-3.1-8B at r = d/8: 4096 * 128256 / (512 * 132352) = 7.7524 (the paper: about 7.75).
    assert ideal_speedup(4096, 128256, 512) == pytest.approx(7.752418, abs=1e-6)


def test_head_shape_from_config():
    assert head_shape_from_config(
        {"slimspec": {"drafter_config": {"hidden_size": 576, "draft_vocab_size": 32000, "vocab_size": 49152}}}
    ) == (576, 32000)
    assert head_shape_from_config({"hidden_size": 4096, "vocab_size": 128256}) == (4096, 128256)
    with pytest.raises(ValueError, match="no 'hidden_size'"):
        head_shape_from_config({"vocab_size": 3})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lowrank_module_is_two_bare_matmuls(dtype):
    # What bench head compares: the module computes exactly (h @ W_down.T) @ W_up.T in the weights' dtype.
    head = LowRankHead(64, 300, 8, dtype=dtype)
    h = torch.randn(3, 64, dtype=dtype, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = head(h)
    assert out.dtype == dtype
    assert torch.equal(out, (h @ head.down.weight.T) @ head.up.weight.T)


def test_bench_head_rows_small_shape():
    cfg = BenchHeadConfig(
        shapes=((64, 1000),),
        ranks=("d/8", "d/16"),
        batch_sizes=(1, 2),
        dtype="fp32",
        trimmed_rows=100,
        repeats=3,
        min_repeats=3,
        device="cpu",
    )
    rows = bench_head(cfg)
    assert [(r.rank, r.batch_size) for r in rows] == [(8, 1), (4, 1), (8, 2), (4, 2)]
    r = rows[0]
    assert (r.hidden_size, r.vocab_size, r.dtype, r.trimmed_rows, r.repeats) == (64, 1000, "float32", 100, 3)
    assert r.ideal_speedup == pytest.approx(64 * 1000 / (8 * 1064))
    assert r.speedup == pytest.approx(r.full_ms / r.lowrank_ms)
    assert r.matmul_speedup == pytest.approx(r.bare_full_ms / r.bare_lowrank_ms)
    assert rows[0].full_ms == rows[1].full_ms  # one interleaved run per batch size: same full-head median


def test_cli_bench_head_json():
    res = CliRunner().invoke(
        app,
        "bench head --hidden-size 64 --vocab-size 512 --ranks 16 --batch-sizes 1 --dtype fp32 --repeats 3 "
        "--threads 1 --device cpu --json".split(),
    )
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)
    assert len(rows) == 1
    keys = {
        "hidden_size",
        "vocab_size",
        "rank",
        "batch_size",
        "dtype",
        "full_ms",
        "lowrank_ms",
        "speedup",
        "ideal_speedup",
        "matmul_speedup",
        "trimmed_ms",
    }
    assert keys <= set(rows[0])
    assert (rows[0]["rank"], rows[0]["ideal_speedup"]) == (16, pytest.approx(64 * 512 / (16 * 576)))
    assert rows[0]["trimmed_ms"] is None  # 32000 trimmed rows >= V = 512: no trimmed head


def test_cli_bench_head_errors():
    res = CliRunner().invoke(app, ["bench", "head", "--hidden-size", "64"])
    assert res.exit_code == 2 and "--hidden-size and --vocab-size go together" in res.output
    res = CliRunner().invoke(
        app, ["bench", "head", "--hidden-size", "64", "--vocab-size", "128", "--dtype", "int8"]
    )
    assert res.exit_code == 2 and "BenchHeadConfig.dtype='int8'" in res.output


def test_cli_bench_head_drafter_shape(tmp_path):

    from slimspec_convert.checkpoint.save import save_drafter

    save_drafter(tiny_drafter(draft_vocab_size=64), tmp_path / "drafter")
    res = CliRunner().invoke(
        app,
        ["bench", "head", "--drafter", str(tmp_path / "drafter")]
        + "--ranks d/8 --batch-sizes 1 --dtype fp32 --repeats 3 --device cpu --json".split(),
    )
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)
    # The drafter's own head: d = 32, V_d = 64 (trimmed), r = 32 / 8 = 4.
    assert [(r["hidden_size"], r["vocab_size"], r["rank"]) for r in rows] == [(32, 64, 4)]
