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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

from .config import DTYPES, BenchHeadConfig
from .head import LowRankHead

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


def resolve_device(device: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu.

    Raises:
        ValueError: cuda asked for but not available, or an unknown name.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch.cuda.is_available() is False; use --device cpu")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: expected auto, cpu or cuda")
    return torch.device(device)


def resolve_dtype(name: str) -> torch.dtype:
    """``bf16``/``bfloat16``/``fp32``/... -> torch dtype.

    Raises:
        ValueError: unknown name.
    """
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r}: expected one of {sorted(DTYPES)}")
    return getattr(torch, DTYPES[name])


def resolve_ranks(ranks: Sequence[int | str], hidden_size: int) -> tuple[int, ...]:
    """Turn ``[512, "d/8"]`` into absolute ranks for hidden size d (sorted descending, deduplicated).

    Args:
        ranks: ints or strings ``"N"`` / ``"d/N"`` (r = d // N).
        hidden_size: d.

    Returns:
        Distinct ranks, largest first.

    Raises:
        ValueError: a malformed entry or a rank outside [1, d].
    """
    out = set()
    for spec in ranks:
        text = str(spec).strip()
        try:
            r = hidden_size // int(text[2:]) if text.startswith("d/") else int(text)
        except (ValueError, ZeroDivisionError) as e:
            raise ValueError(f"rank {spec!r}: expected an integer or d/N (e.g. 512 or d/8)") from e
        if not 1 <= r <= hidden_size:
            raise ValueError(f"rank r={r} (from {spec!r}) is outside [1, hidden_size={hidden_size}]")
        out.add(r)
    return tuple(sorted(out, reverse=True))


def head_shape_from_config(raw: Mapping, where: str = "config.json") -> tuple[int, int]:
    """(d, V_d) of a drafter's head from its parsed config.json (SlimSpec section or flat HF keys).

    Args:
        raw: the parsed config.json.
        where: name used in messages.

    Returns:
        (hidden_size, draft_vocab_size); V_d falls back to ``vocab_size`` when untrimmed.

    Raises:
        ValueError: neither layout names the hidden size.
    """
    section = raw.get("slimspec", {}).get("drafter_config")
    src = section if section else raw
    if "hidden_size" not in src:
        raise ValueError(
            f"{where}: no 'hidden_size' (flat or in the slimspec section); pass --hidden-size/--vocab-size"
        )
    vocab = src.get("draft_vocab_size") or src.get("vocab_size")
    if not vocab:
        raise ValueError(f"{where}: no 'draft_vocab_size' or 'vocab_size'; pass --hidden-size/--vocab-size")
    return int(src["hidden_size"]), int(vocab)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_once(fn: Callable[[], object], device: torch.device, number: int) -> float:
    """ms per call of ``number`` back-to-back calls."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        _synchronize(device)
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
        _synchronize(dev)
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


def ideal_speedup(hidden_size: int, vocab_rows: int, rank: int) -> float:
    """FLOP (and weight-byte) ratio of the full head over the low-rank head: ``d V / (r (d + V))``."""
    return hidden_size * vocab_rows / (rank * (hidden_size + vocab_rows))


@dataclass(frozen=True)
class HeadBenchRow:
    """One (shape, rank, batch size, dtype) of ``bench head``; ms are medians of the same interleaved run.

    Attributes:
        hidden_size, vocab_size, rank, batch_size, dtype, device, threads: the setting.
        full_ms: ``nn.Linear(d, V)`` head.
        lowrank_ms: :class:`LowRankHead` of this rank.
        speedup: full_ms / lowrank_ms.
        ideal_speedup: ``d V / (r (d + V))``.
        matmul_speedup: bare ``h @ W.T`` over bare ``(h @ W_down.T) @ W_up.T``.
        bare_full_ms, bare_lowrank_ms: those two bare matmuls.
        lowrank_overhead: lowrank_ms / bare_lowrank_ms (1.0 = the module adds nothing).
        trimmed_rows, trimmed_ms: a dense head keeping the first ``trimmed_rows`` rows (None when
            trimmed_rows >= V or 0).
        repeats: timed rounds.
    """

    hidden_size: int
    vocab_size: int
    rank: int
    batch_size: int
    dtype: str
    full_ms: float
    lowrank_ms: float
    speedup: float
    ideal_speedup: float
    matmul_speedup: float
    bare_full_ms: float
    bare_lowrank_ms: float
    lowrank_overhead: float
    trimmed_rows: int | None
    trimmed_ms: float | None
    device: str
    threads: int
    repeats: int

    def to_dict(self) -> dict:
        """JSON-ready dict (the keys of issue 5 plus the extras above)."""
        return asdict(self)


def _filled(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> Tensor:
    # Uniform values of nn.Linear's init scale: no NaN/denormal slow paths, and faster than randn.
    bound = shape[-1] ** -0.5
    return torch.empty(shape, dtype=dtype, device=device).uniform_(-bound, bound, generator=gen)


def _shape_rows(
    hidden_size: int, vocab_size: int, ranks: tuple[int, ...], cfg: BenchHeadConfig, device: torch.device
) -> list[HeadBenchRow]:
    """All rows of one head shape (one dense weight allocation, reused for every batch size)."""
    dtype = resolve_dtype(cfg.dtype)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    full = nn.Linear(hidden_size, vocab_size, bias=False, device="meta")
    full.weight = nn.Parameter(_filled((vocab_size, hidden_size), dtype, device, gen), requires_grad=False)
    W = full.weight  # [V, d]
    trimmed = None
    if 0 < cfg.trimmed_rows < vocab_size:
        trimmed = nn.Linear(hidden_size, cfg.trimmed_rows, bias=False, device="meta")
        trimmed.weight = nn.Parameter(W[: cfg.trimmed_rows], requires_grad=False)  # leading rows: a view
    heads = {}
    for r in ranks:
        head = LowRankHead(hidden_size, vocab_size, r, dtype=dtype).to(device).requires_grad_(False)
        head.down.weight.copy_(_filled((r, hidden_size), dtype, device, gen))
        head.up.weight.copy_(_filled((vocab_size, r), dtype, device, gen))
        heads[r] = head
    rows = []
    number = 1 if device.type == "cpu" else 10
    for batch_size in cfg.batch_sizes:
        h = _filled((batch_size, hidden_size), dtype, device, gen)  # [B, d]
        fns: dict[str, Callable[[], object]] = {"full": lambda h=h: full(h), "bare_full": lambda h=h: h @ W.T}
        if trimmed is not None:
            fns["trimmed"] = lambda h=h: trimmed(h)
        for r, head in heads.items():
            Wd, Wu = head.down.weight, head.up.weight
            fns[f"lowrank_{r}"] = lambda h=h, head=head: head(h)
            fns[f"bare_lowrank_{r}"] = lambda h=h, Wd=Wd, Wu=Wu: (h @ Wd.T) @ Wu.T  # [B, r] -> [B, V]
        with torch.inference_mode():
            t = time_interleaved(
                fns,
                device=device,
                warmup=cfg.warmup,
                repeats=cfg.repeats,
                min_repeats=cfg.min_repeats,
                budget_s=cfg.budget_s,
                number=number,
            )
        num_rounds = len(t["full"].samples_ms)
        for r in heads:
            low, bare_low = t[f"lowrank_{r}"].median_ms, t[f"bare_lowrank_{r}"].median_ms
            rows.append(
                HeadBenchRow(
                    hidden_size=hidden_size,
                    vocab_size=vocab_size,
                    rank=r,
                    batch_size=batch_size,
                    dtype=DTYPES[cfg.dtype],
                    full_ms=t["full"].median_ms,
                    lowrank_ms=low,
                    speedup=t["full"].median_ms / low,
                    ideal_speedup=ideal_speedup(hidden_size, vocab_size, r),
                    matmul_speedup=t["bare_full"].median_ms / bare_low,
                    bare_full_ms=t["bare_full"].median_ms,
                    bare_lowrank_ms=bare_low,
                    lowrank_overhead=low / bare_low,
                    trimmed_rows=cfg.trimmed_rows if trimmed is not None else None,
                    trimmed_ms=t["trimmed"].median_ms if trimmed is not None else None,
                    device=str(device),
                    threads=torch.get_num_threads(),
                    repeats=num_rounds,
                )
            )
    return rows


def bench_head(cfg: BenchHeadConfig, progress: Callable[[str], None] | None = None) -> list[HeadBenchRow]:
    """Time the full, low-rank and trimmed heads at every shape, rank and batch size of ``cfg``.

    Weights are random (uniform, nn.Linear's scale): latency does not depend on their values. One
    shape's weights are allocated at a time (the Llama-3.1-8B head is 2.1 GB in float32).

    Args:
        cfg: shapes, ranks (ints or ``d/N``), batch sizes, dtype, device and repeat policy.
        progress: called with a short line before each shape (the CLI prints it to stderr).

    Returns:
        Rows ordered by shape, batch size, rank (largest first).

    Raises:
        ValueError: an unknown dtype/device or a rank outside [1, d].
    """
    device = resolve_device(cfg.device)
    rows: list[HeadBenchRow] = []
    for hidden_size, vocab_size in cfg.shapes:
        ranks = resolve_ranks(cfg.ranks, hidden_size)
        if progress is not None:
            progress(f"head d={hidden_size} V={vocab_size} ranks={list(ranks)} {cfg.dtype} on {device}")
        rows.extend(_shape_rows(hidden_size, vocab_size, ranks, cfg, device))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


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
