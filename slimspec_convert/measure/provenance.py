"""Where and how a benchmark ran, written beside its figures so a generated page can cite them.

``provenance`` blocks are read by ``scripts/make_docs.py`` (``docs/results.md``, the README's headline
table): the date, the exact command, the package versions and the host, never typed by hand.
"""

from __future__ import annotations

import datetime
import os
import platform
from pathlib import Path

import torch
import transformers

from slimspec_convert.version import __version__

# Set by a script that runs the benchmark as one step of a larger job (examples/quickstart.sh): the
# job's own command line, which a results page cites as the command that reproduces the table.
JOB_ENV = "SLIMSPEC_JOB"


def host_cpu(cpuinfo: Path = Path("/proc/cpuinfo"), meminfo: Path = Path("/proc/meminfo")) -> str:
    """The host in a few words: cores, CPU model, memory and GPU, e.g.
    ``"2-core AMD EPYC 9R14 Processor, 24 GiB, no GPU"``.

    Args:
        cpuinfo, meminfo: Linux's descriptions (elsewhere ``platform.processor()`` and no memory figure).
    """
    model = platform.processor() or platform.machine()
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                model = line.partition(":")[2].strip()
                break
    parts = [f"{os.cpu_count()}-core {model}"]
    if meminfo.is_file():
        for line in meminfo.read_text(errors="replace").splitlines():
            if line.startswith("MemTotal:"):
                parts.append(f"{round(int(line.split()[1]) / 2**20)} GiB")
                break
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    parts.append(gpu)
    return ", ".join(parts)


def provenance(command: str, target: str, prompts: str, now: datetime.datetime | None = None) -> dict:
    """The provenance block of one run.

    Args:
        command: the exact command line of the run (e.g. ``slimspec bench e2e ...``).
        target: the target as given.
        prompts: which prompts, in words (file, how many, calibration prompts).
        now: the time to record (default: now, UTC).

    Returns:
        ``{"date", "time_utc", "command", "job", "machine", "versions", "target", "prompts"}``;
        ``job`` is the command of the enclosing job (``$SLIMSPEC_JOB``) or None.
    """
    now = now or datetime.datetime.now(datetime.timezone.utc)
    return {
        "date": now.strftime("%Y-%m-%d"),
        "time_utc": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": command,
        "job": os.environ.get(JOB_ENV) or None,
        "machine": host_cpu(),
        "versions": {
            "slimspec": __version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "target": target,
        "prompts": prompts,
    }
