"""LM-head latency: full vs low-rank vs trimmed heads at given shapes.

Interleaved timings; every ratio comes from one run."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

from slimspec_convert.devices import check_device_name, resolve_device
from slimspec_convert.dtypes import DTYPES, check_dtype_name, torch_dtype
from slimspec_convert.measure.machine import MachineState, machine_state, timing_spread
from slimspec_convert.measure.timing import time_interleaved
from slimspec_convert.model.head import LowRankHead

# ---- benchmarks, trimming, rank sweep (issue 5) ------------------------------------------------
# The paper's three target shapes (drafter hidden size d, vocabulary V), SlimSpec section 5.
PAPER_HEAD_SHAPES: dict[str, tuple[int, int]] = {
    "Llama-3.1-8B": (4096, 128256),
    "gpt-oss-20b": (2880, 201088),
    "Qwen3-30B-A3B": (2048, 151936),
}


DEFAULT_BENCH_RANK_DIVISORS = (8, 16)  # r = d/8 (paper default) and d/16


DEFAULT_BENCH_BATCH_SIZES = (1, 64)


DEFAULT_BENCH_DTYPE = "bfloat16"


DEFAULT_TRIMMED_ROWS = 32000  # EAGLE-3's 32k draft vocabulary


DEFAULT_BENCH_WARMUP = 1  # interleaved warm-up rounds before timing


DEFAULT_BENCH_REPEATS = 15  # at most this many interleaved timed rounds ...


DEFAULT_BENCH_MIN_REPEATS = 3  # ... and at least this many, whatever the time budget


DEFAULT_BENCH_BUDGET_S = 20.0  # timed seconds per (shape, batch size, dtype) before repeats are capped


@dataclass(frozen=True)
class BenchHeadConfig:
    """Options of ``slimspec bench head``: which head shapes, ranks and batch sizes to time.

    ``ranks`` entries are absolute ranks (int) or ``"d/N"`` strings resolved per shape.
    """

    shapes: tuple[tuple[int, int], ...] = tuple(PAPER_HEAD_SHAPES.values())
    ranks: tuple[int | str, ...] = tuple(f"d/{n}" for n in DEFAULT_BENCH_RANK_DIVISORS)
    batch_sizes: tuple[int, ...] = DEFAULT_BENCH_BATCH_SIZES
    dtype: str = DEFAULT_BENCH_DTYPE
    trimmed_rows: int = DEFAULT_TRIMMED_ROWS
    warmup: int = DEFAULT_BENCH_WARMUP
    repeats: int = DEFAULT_BENCH_REPEATS
    min_repeats: int = DEFAULT_BENCH_MIN_REPEATS
    budget_s: float = DEFAULT_BENCH_BUDGET_S
    device: str = "auto"
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.shapes:
            raise ValueError("BenchHeadConfig.shapes is empty: give at least one (hidden_size, vocab_size)")
        for d, v in self.shapes:
            if d < 1 or v < 1:
                raise ValueError(f"BenchHeadConfig.shapes: (hidden_size={d}, vocab_size={v}): must be > 0")
        if not self.ranks:
            raise ValueError("BenchHeadConfig.ranks is empty")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"BenchHeadConfig.batch_sizes={self.batch_sizes}: expected positive integers")
        check_dtype_name("BenchHeadConfig", self.dtype)
        if self.trimmed_rows < 0:
            raise ValueError(f"BenchHeadConfig.trimmed_rows={self.trimmed_rows}: expected >= 0 (0 = skip)")
        if self.warmup < 0 or self.min_repeats < 1 or self.repeats < self.min_repeats:
            raise ValueError(
                f"BenchHeadConfig: warmup={self.warmup}, min_repeats={self.min_repeats}, "
                f"repeats={self.repeats}: expected warmup >= 0 and 1 <= min_repeats <= repeats"
            )
        if self.budget_s <= 0:
            raise ValueError(f"BenchHeadConfig.budget_s={self.budget_s}: expected > 0")
        check_device_name("BenchHeadConfig", self.device)


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
        machine: load average and timing spread of this batch size's run, and whether the machine
            counted as busy (:mod:`slimspec_convert.measure.machine`).
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
    machine: MachineState | None = None

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
    dtype = torch_dtype(cfg.dtype)
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
        spread = max(timing_spread(v.samples_ms) for n, v in t.items() if not n.startswith("bare_"))
        machine = machine_state(spread)
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
                    machine=machine,
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
