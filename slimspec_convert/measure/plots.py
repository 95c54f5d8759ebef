"""PNG plots of benchmark results (matplotlib, Agg backend; files are written atomically)."""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

from slimspec_convert.atomic import atomic_write_bytes


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=110)
    return plt, fig, ax


def _save(plt, fig, path: Path) -> Path:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
    return path


def plot_rank_vs_acceptance(
    ranks: Sequence[int],
    acceptance: Sequence[float],
    top1: Sequence[float],
    full_acceptance: float,
    full_top1: float,
    path: Path,
) -> Path:
    """Rank (log2 axis) vs offline expected acceptance and top-1 agreement, full head as dashed lines.

    Args:
        ranks: r per point.
        acceptance: mean ``sum_v min(p_target, q_draft)`` per rank, in [0, 1].
        top1: mean top-1 agreement per rank.
        full_acceptance: the full head's expected acceptance.
        full_top1: the full head's top-1 agreement.
        path: output PNG.

    Returns:
        ``path``.
    """
    plt, fig, ax = _figure()
    ax.plot(ranks, acceptance, "o-", color="C0", label="expected acceptance, low-rank")
    ax.plot(ranks, top1, "s-", color="C1", label="top-1 agreement, low-rank")
    ax.axhline(full_acceptance, color="C0", ls="--", lw=1, label="expected acceptance, full head")
    ax.axhline(full_top1, color="C1", ls="--", lw=1, label="top-1 agreement, full head")
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(ranks), [str(r) for r in ranks])
    ax.set_xlabel("rank r")
    ax.set_ylabel("per-position acceptance (step 0)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    ax.set_title("rank vs offline acceptance (held-out data)")
    return _save(plt, fig, path)


def plot_rank_vs_latency(
    ranks: Sequence[int], head_ms: Sequence[float], full_head_ms: float, path: Path, *, label: str = ""
) -> Path:
    """Rank (log2 axis) vs measured head latency (ms per call), full head as a dashed line.

    Returns:
        ``path``.
    """
    plt, fig, ax = _figure()
    ax.plot(ranks, head_ms, "o-", color="C2", label="low-rank head")
    ax.axhline(full_head_ms, color="k", ls="--", lw=1, label="full head")
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(ranks), [str(r) for r in ranks])
    ax.set_xlabel("rank r")
    ax.set_ylabel("head latency, ms per call (median)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax.set_title(f"rank vs head latency {label}".strip())
    return _save(plt, fig, path)


def plot_predicted_vs_measured(
    names: Sequence[str],
    predicted: Sequence[float],
    measured: Sequence[float],
    path: Path,
    *,
    speedup_names: Sequence[str] = (),
    speedup_vs_plain: Sequence[float] = (),
) -> Path:
    """End-to-end speed in two panels: tokens/s relative to plain decoding for every row (plain = 1.0),
    and predicted (cost model) vs measured speedup over the full-head drafter, one bar pair each.

    The left panel makes it visible when every drafter is slower than plain decoding (bars below
    the 1.0 line), which the right panel, relative to the full-head drafter, cannot show.

    Args:
        names: drafters with a cost-model prediction (right panel).
        predicted, measured: rho_TPS per drafter in ``names``.
        path: output PNG.
        speedup_names: every row, plain decoding first (left panel; omitted when empty).
        speedup_vs_plain: tokens/s over plain decoding's per row in ``speedup_names`` (plain = 1.0).

    Returns:
        ``path``.

    Raises:
        ValueError: ``speedup_names`` and ``speedup_vs_plain`` of different lengths.
    """
    if len(speedup_names) != len(speedup_vs_plain):
        raise ValueError(
            f"speedup_names has {len(speedup_names)} entries, speedup_vs_plain {len(speedup_vs_plain)}"
        )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 2 if speedup_names else 1
    fig, axes = plt.subplots(1, panels, figsize=(6.4 * panels, 4.2), dpi=110, squeeze=False)
    if speedup_names:
        ax = axes[0][0]
        xs = range(len(speedup_names))
        # plain decoding grey, faster than it green, slower red
        colors = ["0.6"] + ["C2" if v >= 1.0 else "C3" for v in speedup_vs_plain[1:]]
        ax.bar(list(xs), list(speedup_vs_plain), width=0.6, color=colors)
        for x, v in zip(xs, speedup_vs_plain, strict=True):
            ax.annotate(f"{v:.2f}", (x, v), ha="center", va="bottom", fontsize=8)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(list(xs), list(speedup_names), rotation=20)
        ax.set_ylabel("tokens/s relative to plain decoding")
        ax.set_title("speedup over plain target decoding")
    ax = axes[0][-1]
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], predicted, width=0.4, label="predicted rho_TPS", color="C0")
    ax.bar([x + 0.2 for x in xs], measured, width=0.4, label="measured rho_TPS", color="C1")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(list(xs), list(names), rotation=20)
    ax.set_ylabel("tokens/s relative to the full-head drafter")
    ax.legend(fontsize=8)
    ax.set_title("predicted vs measured speedup")
    return _save(plt, fig, path)
