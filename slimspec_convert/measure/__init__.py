"""Timing and metrics: head latency, kappa, offline acceptance, end-to-end runs, tables and plots.
Data in, data out; files only as plots.
"""

from slimspec_convert.measure.acceptance import AcceptanceStats, expected_acceptance_by_head
from slimspec_convert.measure.e2e import BenchE2EConfig, E2EResult, run_e2e
from slimspec_convert.measure.head_latency import BenchHeadConfig, bench_head
from slimspec_convert.measure.kappa import measure_kappa
from slimspec_convert.measure.tables import e2e_markdown, fmt_number
from slimspec_convert.measure.timing import time_interleaved

__all__ = [
    "AcceptanceStats",
    "BenchE2EConfig",
    "BenchHeadConfig",
    "E2EResult",
    "bench_head",
    "e2e_markdown",
    "expected_acceptance_by_head",
    "fmt_number",
    "measure_kappa",
    "run_e2e",
    "time_interleaved",
]
