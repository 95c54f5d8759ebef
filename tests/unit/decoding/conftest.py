"""Fixtures of the decoding tests: one tiny 16-token target and three MT-Bench prompts for it."""

from __future__ import annotations

import pytest

from tests.helpers.decoding import V, mt_bench_ids
from tests.helpers.models import tiny_target


@pytest.fixture(scope="module")
def target16():
    return tiny_target(seed=3, vocab_size=V)


@pytest.fixture(scope="module")
def prompts16():
    return mt_bench_ids(3, V)
