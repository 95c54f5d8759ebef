"""Timing harnesses: interleaved repeated runs after warm-up, medians, ratios measured in the same run.

Every ratio reported here compares callables timed in the *same* interleaved loop (round i runs each
callable once, in an order rotated by i), so slow drift of the machine (another job, clock changes)
hits both sides of a ratio alike. On CUDA each sample is bracketed by CUDA events; on CPU by
``time.perf_counter_ns``.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from slimspec_convert.devices import synchronize

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Timing:
    """Samples of one callable.

    Attributes:
        median_ms: median over the timed rounds, milliseconds per call.
        samples_ms: every timed round, ms per call (a round may average ``number`` back-to-back calls).
    """

    median_ms: float
    samples_ms: tuple[float, ...]


def _time_once(fn: Callable[[], object], device: torch.device, number: int) -> float:
    """ms per call of ``number`` back-to-back calls."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        synchronize(device)
        start.record()
        for _ in range(number):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / number
    t0 = time.perf_counter_ns()
    for _ in range(number):
        fn()
    return (time.perf_counter_ns() - t0) / 1e6 / number


def time_interleaved(
    fns: Mapping[str, Callable[[], object]],
    *,
    device: torch.device | str = "cpu",
    warmup: int = 1,
    repeats: int = 15,
    min_repeats: int = 3,
    budget_s: float | None = None,
    number: int = 1,
) -> dict[str, Timing]:
    """Time several callables in interleaved rounds and return their medians.

    ``warmup`` untimed rounds run first. Then round i calls every callable once (``number`` times
    back to back) in the key order rotated by i. The number of timed rounds is ``repeats``, reduced
    so that the timed rounds fit in ``budget_s`` seconds (estimated from the last warm-up round),
    but never below ``min_repeats``.

    Args:
        fns: name -> zero-argument callable (its result is discarded).
        device: where the work runs; CUDA events time each sample there.
        warmup: untimed rounds (>= 0; at least one round is always run to estimate the budget).
        repeats: the most timed rounds.
        min_repeats: the fewest timed rounds.
        budget_s: seconds allowed for the timed rounds, or None for exactly ``repeats``.
        number: calls per sample (amortises launch/event overhead on GPUs).

    Returns:
        name -> :class:`Timing` (ms per call).

    Raises:
        ValueError: no callables, or repeats/min_repeats/number < 1.
    """
    if not fns:
        raise ValueError("time_interleaved: no callables to time")
    if min(repeats, min_repeats, number) < 1:
        raise ValueError(f"repeats={repeats}, min_repeats={min_repeats}, number={number}: expected >= 1")
    dev = torch.device(device)
    names = list(fns)
    round_s = 0.0
    for _ in range(max(1, warmup)):
        t0 = time.perf_counter()
        for name in names:
            fns[name]()
        synchronize(dev)
        round_s = time.perf_counter() - t0
    num_rounds = repeats
    if budget_s is not None and round_s > 0:
        num_rounds = max(min_repeats, min(repeats, int(budget_s / (round_s * number))))
    samples: dict[str, list[float]] = {n: [] for n in names}
    for i in range(num_rounds):
        for j in range(len(names)):
            name = names[(i + j) % len(names)]
            samples[name].append(_time_once(fns[name], dev, number))
    logger.info("timed %d callables x %d rounds", len(names), num_rounds)
    return {n: Timing(statistics.median(s), tuple(s)) for n, s in samples.items()}


def time_module_calls(
    modules: Mapping[str, nn.Module],
    inputs: Tensor,
    *,
    warmup: int = 1,
    repeats: int = 15,
    device: torch.device | str = "cpu",
) -> dict[str, float]:
    """Median ms of ``module(inputs)`` for several modules, interleaved, under inference mode.

    Args:
        modules: name -> module (e.g. the full head and low-rank heads of one drafter).
        inputs: [..., d] input shared by all modules.
        warmup: untimed rounds.
        repeats: timed rounds.
        device: where the modules live.

    Returns:
        name -> median milliseconds per call.
    """
    fns = {name: (lambda m=m: m(inputs)) for name, m in modules.items()}
    with torch.inference_mode():
        t = time_interleaved(fns, device=device, warmup=warmup, repeats=repeats, min_repeats=min(3, repeats))
    return {n: v.median_ms for n, v in t.items()}
