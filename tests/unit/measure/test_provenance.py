"""The provenance block of a benchmark: date, command, versions and host, as make_docs.py cites them."""

from __future__ import annotations

import datetime

import torch
import transformers

from slimspec_convert.measure import provenance as prov
from slimspec_convert.version import __version__


def test_host_cpu_reads_the_model_name_and_memory(tmp_path, monkeypatch):
    cpuinfo, meminfo = tmp_path / "cpuinfo", tmp_path / "meminfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: AMD EPYC 9R14\nflags\t: avx\n")
    meminfo.write_text("MemTotal:       25165824 kB\nMemFree:  1 kB\n")  # 24 GiB
    monkeypatch.setattr(prov.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(prov.torch.cuda, "is_available", lambda: False)
    assert prov.host_cpu(cpuinfo, meminfo) == "2-core AMD EPYC 9R14, 24 GiB, no GPU"


def test_provenance_names_the_date_command_versions_and_job(monkeypatch):
    now = datetime.datetime(2026, 12, 6, 17, 5, 9, tzinfo=datetime.timezone.utc)
    monkeypatch.setenv(prov.JOB_ENV, "bash examples/quickstart.sh runs/x")
    p = prov.provenance("slimspec bench e2e --target T", "T", "the first 2 of P", now=now)
    assert (p["date"], p["time_utc"]) == ("2026-12-06", "2026-12-06T17:05:09Z")
    assert (p["command"], p["job"], p["target"]) == (
        "slimspec bench e2e --target T",
        "bash examples/quickstart.sh runs/x",
        "T",
    )
    assert p["versions"]["slimspec"] == __version__ and p["versions"]["torch"] == torch.__version__
    assert p["versions"]["transformers"] == transformers.__version__
    monkeypatch.delenv(prov.JOB_ENV)
    assert prov.provenance("c", "T", "P", now=now)["job"] is None
