"""Busy-machine detection recorded beside benchmark results: load average against cores, timing spread."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import slimspec_convert.measure.machine as machine
from slimspec_convert.cli.app import app
from slimspec_convert.measure.machine import DEFAULT_MAX_TIMING_SPREAD, assess_machine, timing_spread


def test_timing_spread_is_iqr_over_median():
    # inclusive quartiles of [10, 11, 12, 14]: 10.75 and 12.5; median 11.5
    assert timing_spread([14.0, 10.0, 12.0, 11.0]) == pytest.approx(1.75 / 11.5)
    assert timing_spread([5.0, 5.0, 5.0]) == 0.0
    assert timing_spread([7.0]) == 0.0


def test_assess_machine_names_every_reason():
    quiet = assess_machine(1.5, 2, 0.05)
    assert (quiet.busy, quiet.reason) == (False, None)
    loaded = assess_machine(3.5, 2)
    assert loaded.busy and loaded.reason == "1-min load average 3.50 > 2 cores"
    noisy = assess_machine(0.2, 16, 0.30)
    assert (
        noisy.busy and noisy.reason == f"timing spread (IQR / median) 0.30 > {DEFAULT_MAX_TIMING_SPREAD:.2f}"
    )
    both = assess_machine(20.0, 16, 0.5, max_spread=0.4)
    assert both.reason == "1-min load average 20.00 > 16 cores; timing spread (IQR / median) 0.50 > 0.40"
    assert assess_machine(None, 2).to_dict() == {
        "load_1m": None,
        "cpu_count": 2,
        "timing_spread": None,
        "busy": False,
        "reason": None,
    }


def _bench_head(*extra):
    args = "bench head --hidden-size 64 --vocab-size 512 --ranks 16 --batch-sizes 1".split()
    args += ["--dtype", "fp32", "--repeats", "3", "--device", "cpu", "--json", *extra]
    return CliRunner().invoke(app, args)


def test_bench_head_records_the_machine_and_warns_when_busy(monkeypatch):
    monkeypatch.setattr(machine, "read_load_1m", lambda: 0.0)
    monkeypatch.setattr(machine.os, "cpu_count", lambda: 2)
    res = _bench_head()
    assert res.exit_code == 0, res.output
    m = json.loads(res.stdout)[0]["machine"]
    assert (m["load_1m"], m["cpu_count"]) == (0.0, 2) and m["timing_spread"] >= 0.0
    assert m["busy"] == (m["timing_spread"] > DEFAULT_MAX_TIMING_SPREAD)
    monkeypatch.setattr(machine, "read_load_1m", lambda: 7.25)
    res = _bench_head()
    m = json.loads(res.stdout)[0]["machine"]
    assert m["busy"] and m["reason"].startswith("1-min load average 7.25 > 2 cores")
    assert f"warning: busy machine ({m['reason']}): timings are noisy" in res.stderr
