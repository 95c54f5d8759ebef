"""Busy-machine detection recorded beside benchmark results: load average against cores, timing spread."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

import slimspec_convert.measure.machine as machine
from slimspec_convert.cli.app import app, bench_app
from slimspec_convert.measure.machine import (
    DEFAULT_MAX_TIMING_SPREAD,
    assess_machine,
    choose_threads,
    default_threads,
    other_cpu_load,
    timing_machine,
    timing_spread,
)


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


@pytest.mark.parametrize(
    "load, cores, threads",
    [
        (0.3, 2, 2),
        (0.5, 2, 2),
        (0.51, 2, 1),
        (1.0, 2, 1),
        (2.0, 2, 1),
        (8.0, 2, 1),
        (1.2, 8, 7),
        (None, 4, 4),
    ],
)
def test_default_threads_leave_the_cores_others_use(load, cores, threads):
    assert default_threads(load, cores) == threads  # round(cores - load), at least 1, at most cores


def test_choose_threads_asked_env_and_default(monkeypatch):
    monkeypatch.setattr(machine, "read_load_1m", lambda: 3.1)
    monkeypatch.setattr(machine, "read_other_load", lambda: 1.2)
    monkeypatch.setattr(machine, "read_runnable_others", lambda: 0)
    monkeypatch.setattr(machine, "usable_cores", lambda: 2)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    auto = choose_threads(None)
    assert (auto.threads, auto.reduced) == (1, True)
    assert auto.summary() == (
        "threads: 1 of 2 cores (other processes busy on 1.2 cores, 1-min load average 3.10, 0 other "
        "processes runnable at start: other work holds the rest; pass --threads N to choose)"
    )
    # the previous command of a script has ended: the 1-min average still holds it, the CPU time does not
    monkeypatch.setattr(machine, "read_other_load", lambda: 0.05)
    assert choose_threads(None).threads == 2
    monkeypatch.setattr(machine, "read_other_load", lambda: None)  # no /proc/stat: the average decides
    assert choose_threads(None).threads == 1
    monkeypatch.setattr(machine, "read_load_1m", lambda: 0.2)  # two jobs just started: the average lags
    monkeypatch.setattr(machine, "read_runnable_others", lambda: 2)
    assert choose_threads(None).threads == 1
    monkeypatch.setattr(machine, "read_runnable_others", lambda: 0)
    assert choose_threads(None).threads == 2
    assert choose_threads(2).threads == 2 and not choose_threads(2).reduced
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert choose_threads(None).threads == 2 and not choose_threads(None).reduced
    monkeypatch.setenv("OMP_NUM_THREADS", "two")
    with pytest.raises(ValueError, match="OMP_NUM_THREADS='two': expected a positive integer"):
        choose_threads(None)
    with pytest.raises(ValueError, match="--threads=0: expected >= 1"):
        choose_threads(0)


def test_every_command_takes_threads_and_says_what_the_default_chose(monkeypatch):
    monkeypatch.setattr(machine, "read_load_1m", lambda: 9.0)
    monkeypatch.setattr(machine, "read_other_load", lambda: None)
    monkeypatch.setattr(machine, "read_runnable_others", lambda: 3)
    monkeypatch.setattr(machine, "usable_cores", lambda: 2)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    runner = CliRunner()
    names = [[c.name or c.callback.__name__.replace("_", "-")] for c in app.registered_commands]
    names += [["bench", c.name or c.callback.__name__] for c in bench_app.registered_commands]
    assert len(names) >= 12 and ["convert"] in names and ["finetune"] in names and ["bench", "e2e"] in names
    for name in names:
        assert "--threads" in runner.invoke(app, [*name, "--help"], terminal_width=200).output, name
    res = runner.invoke(app, ["inspect", "/nonexistent-drafter"])
    first = res.output.splitlines()[0]
    assert res.exit_code == 2 and first.startswith("threads: 1 of 2 cores (1-min load average 9.00"), (
        res.output
    )


def test_timing_machine_counts_the_threads_a_timing_used(monkeypatch):
    monkeypatch.setattr(machine, "usable_cores", lambda: 2)
    assert not timing_machine(0.4, 2).busy and timing_machine(0.6, 2).busy
    assert not timing_machine(1.4, 1).busy and timing_machine(1.6, 1).busy
    assert (
        timing_machine(2.0, 1).reason
        == "other processes busy on 2.00 cores before timing + 1 threads > 2 cores + 0.5"
    )
    assert not timing_machine(None, 2).busy


def test_other_cpu_load_leaves_out_this_process():
    # 0.5 s at 100 ticks/s on 2 cores: 100 ticks of capacity; the machine was busy 90 ticks, 40 of them ours
    assert other_cpu_load((1000, 1090), (200, 240), 0.5, 100.0) == pytest.approx(1.0)
    assert other_cpu_load((1000, 1040), (200, 240), 0.5, 100.0) == 0.0  # only this process ran
    assert other_cpu_load((0, 200), (0, 0), 1.0, 100.0) == pytest.approx(2.0)  # two spinning processes


def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def test_read_other_load_counts_another_process():
    if not os.path.exists("/proc/stat"):
        pytest.skip("no /proc/stat")
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        hz, t0, before = os.sysconf("SC_CLK_TCK"), time.perf_counter(), _cpu_ticks(spin.pid)
        loaded = machine.read_other_load(0.5)
        spun = (_cpu_ticks(spin.pid) - before) / ((time.perf_counter() - t0) * hz)
    finally:
        spin.kill()
        spin.wait()
    # whatever else the machine runs, the other process's share of a core is in the reading
    assert loaded is not None and loaded >= spun - 0.2, (loaded, spun)
