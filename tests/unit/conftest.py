"""Unit tests write no cache files outside pytest's temporary folders."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def _unit_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("slimspec-cache")


@pytest.fixture(autouse=True)
def _cache_in_tmp(_unit_cache, monkeypatch):
    """``$SLIMSPEC_CACHE`` points at a session temporary folder (timings cached by ``auto`` settings)."""
    monkeypatch.setenv("SLIMSPEC_CACHE", str(_unit_cache))
