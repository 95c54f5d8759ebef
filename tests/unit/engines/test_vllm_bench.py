"""The vLLM plugin's pure parts, without vLLM: spec-decode counter arithmetic, the bench's options and
its table (vLLM itself is exercised by the tier in tests/vllm)."""

from __future__ import annotations

import pytest

from slimspec_convert.engines.vllm.bench import BenchVllmConfig, table
from slimspec_convert.engines.vllm.run import SpecCounters, counters_between


def test_counters_give_vllms_mean_acceptance_length_and_per_position_rates():
    before = SpecCounters(10, 30, 12, (6, 4, 2))
    after = SpecCounters(30, 90, 42, (20, 14, 8))
    run = counters_between(before, after)
    assert run == SpecCounters(20, 60, 30, (14, 10, 6))
    assert run.mean_acceptance_length == 2.5  # 1 + 30 accepted / 20 drafts
    assert run.acceptance_per_pos == [0.7, 0.5, 0.3]
    assert SpecCounters().mean_acceptance_length is None and SpecCounters().acceptance_per_pos == []


def test_bench_config_refuses_bad_drafters_and_sizes():
    cfg = BenchVllmConfig(target="t", drafters=("full=a", "slim=b/c=d"))
    assert cfg.drafter_map() == {"full": "a", "slim": "b/c=d"}
    with pytest.raises(ValueError, match="BenchVllmConfig.drafters: 'plain=x': expected NAME=FOLDER"):
        BenchVllmConfig(target="t", drafters=("plain=x",))
    with pytest.raises(ValueError, match="BenchVllmConfig.batch_sizes=\\(0,\\): expected sizes >= 1"):
        BenchVllmConfig(target="t", drafters=(), batch_sizes=(0,))


def test_table_rows_from_a_record():
    row = {"vllm_mean_acceptance_length": None, "vllm_acceptance_per_pos": [], "ours_tau": None}
    record = {
        "config": {"dtype": "float32", "depth": 3, "max_new_tokens": 64},
        "env": {"OMP_NUM_THREADS": "2"},
        "machine": {"vllm": "0.32.0"},
        "prompts": ["a", "b"],
        "rows": [
            {
                **row,
                "drafter": "plain",
                "batch_size": 1,
                "tokens_per_s": 20.0,
                "lossless": None,
                "num_lossless": 2,
            },
            {
                "drafter": "slim",
                "batch_size": 1,
                "tokens_per_s": 25.0,
                "lossless": False,
                "num_lossless": 1,
                "vllm_mean_acceptance_length": 1.75,
                "vllm_acceptance_per_pos": [0.5, 0.25, 0.0],
                "ours_tau": 1.8,
            },
        ],
    }
    lines = table(record).splitlines()
    assert lines[-2:] == [
        "| plain | 1 | 20.00 | 1.00x | - | - | - | - |",
        "| slim | 1 | 25.00 | 1.25x | 1.750 | 0.50, 0.25, 0.00 | 1.800 | no (1 equal) |",
    ]
