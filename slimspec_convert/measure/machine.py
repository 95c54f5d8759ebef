"""Is the machine quiet enough to trust a timing? The 1-min load average against the core count, and
the spread of repeated timings, recorded beside every benchmark result.

A benchmark on a shared machine still runs, but its result says so: ``machine.busy`` is True with the
reason (load above the number of cores: runnable processes are queuing for a core; or repeated
timings of one callable spread by more than :data:`DEFAULT_MAX_TIMING_SPREAD` of their median).
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass

# Interquartile range over median of repeated timings above which a run counts as noisy. A quiet
# CPU or GPU keeps it to a few percent for the head matmuls; a second job on the cores makes it tens.
DEFAULT_MAX_TIMING_SPREAD = 0.15


@dataclass(frozen=True)
class MachineState:
    """The machine during a benchmark.

    Attributes:
        load_1m: 1-min load average (``os.getloadavg``), None where the OS has none.
        cpu_count: cores the OS reports (``os.cpu_count``).
        timing_spread: largest (q75 - q25) / median over the timed callables, None when not measured.
        busy: load_1m > cpu_count, or timing_spread > the threshold.
        reason: why it is busy (None when it is not).
    """

    load_1m: float | None
    cpu_count: int
    timing_spread: float | None
    busy: bool
    reason: str | None

    def to_dict(self) -> dict:
        """JSON-ready dict."""
        return asdict(self)


def timing_spread(samples_ms: Sequence[float]) -> float:
    """Interquartile range over median of repeated timings (0 for fewer than two samples).

    Quartiles are ``statistics.quantiles(..., n=4, method="inclusive")`` (linear interpolation
    between order statistics, as numpy's default): for [10, 11, 12, 14] they are 10.75 and 12.5, the
    median 11.5, the spread 1.75 / 11.5.

    Args:
        samples_ms: one callable's timed rounds, ms.

    Returns:
        A non-negative float.
    """
    if len(samples_ms) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(samples_ms, n=4, method="inclusive")
    median = statistics.median(samples_ms)
    return (q3 - q1) / median if median > 0 else 0.0


def assess_machine(
    load_1m: float | None,
    cpu_count: int,
    spread: float | None = None,
    max_spread: float = DEFAULT_MAX_TIMING_SPREAD,
) -> MachineState:
    """Decide whether a measurement ran on a busy machine (pure: the readings are arguments).

    Args:
        load_1m: 1-min load average, or None when unknown.
        cpu_count: cores.
        spread: :func:`timing_spread` of the run, or None when not measured.
        max_spread: the spread above which timings count as noisy.

    Returns:
        :class:`MachineState`.
    """
    reasons = []
    if load_1m is not None and load_1m > cpu_count:
        reasons.append(f"1-min load average {load_1m:.2f} > {cpu_count} cores")
    if spread is not None and spread > max_spread:
        reasons.append(f"timing spread (IQR / median) {spread:.2f} > {max_spread:.2f}")
    return MachineState(load_1m, cpu_count, spread, bool(reasons), "; ".join(reasons) or None)


def read_load_1m() -> float | None:
    """The 1-min load average, None where ``os.getloadavg`` is unavailable."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def machine_state(spread: float | None = None, load_1m: float | None = None) -> MachineState:
    """:func:`assess_machine` of this machine now (``load_1m`` None reads it).

    Args:
        spread: the run's timing spread, if measured.
        load_1m: a load reading taken earlier (e.g. the larger of the readings before and after a run).
    """
    return assess_machine(load_1m if load_1m is not None else read_load_1m(), os.cpu_count() or 1, spread)
