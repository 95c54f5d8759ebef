"""What ``slimspec convert`` reports: :class:`ConvertReport`, also written to ``OUT/slimspec_report.json``."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from slimspec_convert.version import __version__


@dataclass
class ConvertReport:
    """What ``convert`` did (also written to ``OUT/slimspec_report.json``).

    Attributes:
        source / out: folders.
        source_format: dialect of the source.
        rank: kept rank r; rank_rule: how r was chosen.
        hidden_size: d; vocab_size: rows of the new head (V_d, or V_t with full_vocab).
        params_before: parameters of the source head (V_d d); params_after: r (d + rows).
        relative_error: ||W - W_up W_down||_F / ||W||_F (of the float32/64 factors before the cast;
            W is the assembled full-vocabulary head when full_vocab).
        energy_retained: sum_{i<r} s_i^2 / ||W||_F^2.
        seconds: wall time of the conversion.
        svd_method: "exact", "randomized" (svd_niter extra Krylov blocks) or "calibrated".
        calibration: with calibration data: rows, source, damp and the expected logit error
            ``logit_relative_error`` of the factors next to ``svd_logit_relative_error`` of the
            plain truncated SVD (both under the damped calibration moment).
        factor_dtype / source_dtype: storage dtypes.
        full_vocab: rows added from the target (target_rows_added) to a trimmed head.
        vocab_maps: what happened to d2t / t2d.
        head_vs_target: cosine / norm statistics of the drafter's rows against the target rows of
            the same tokens (only with a target; P20: speculators heads are target rows).
        notes: anything else worth knowing.
        head_is_embedding: the factorised head equals the embedding table row for row (a tied
            head; the shortlist rerank needs it); None when no embedding was at hand.
        warnings: what the user should act on (the CLI prints each on stderr): an uncalibrated
            result, which accepts almost nothing before calibration or fine-tuning.
    """

    source: str
    out: str
    source_format: str
    rank: int
    rank_rule: str
    hidden_size: int
    vocab_size: int
    source_vocab_rows: int
    params_before: int
    params_after: int
    relative_error: float
    energy_retained: float
    seconds: float
    svd_method: str
    svd_niter: int | None
    factor_dtype: str
    source_dtype: str
    full_vocab: bool
    target_rows_added: int
    vocab_maps: str
    head_vs_target: dict[str, float] = field(default_factory=dict)
    calibration: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    head_is_embedding: bool | None = None
    warnings: list[str] = field(default_factory=list)
    version: str = __version__

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return asdict(self)

    def to_json(self) -> str:
        """Indented JSON text."""
        return json.dumps(self.to_dict(), indent=2)

    def summary(self) -> str:
        """Aligned two-column text table."""
        rows = [
            ("source", f"{self.source} ({self.source_format})"),
            ("out", self.out),
            ("rank r", f"{self.rank} ({self.rank_rule})"),
            (
                "head",
                f"[{self.vocab_size}, {self.hidden_size}] -> W_up [{self.vocab_size}, {self.rank}] "
                f"@ W_down [{self.rank}, {self.hidden_size}]",
            ),
            (
                "params before / after",
                f"{self.params_before:,} / {self.params_after:,} "
                f"({self.params_after / self.params_before:.3f}x)",
            ),
            ("relative_error", f"{self.relative_error:.6f}  (||W - W_up W_down||_F / ||W||_F)"),
            (
                "energy_retained",
                f"{self.energy_retained:.6f}"
                + ("  (share of E||W h||^2 kept, calibration data)" if self.calibration else ""),
            ),
            ("svd", self.svd_method + (f" (niter={self.svd_niter})" if self.svd_niter is not None else "")),
        ]
        if self.calibration:
            c = self.calibration
            rows.append(
                (
                    "logit error",
                    f"{c['logit_relative_error']:.4f} calibrated vs "
                    f"{c['svd_logit_relative_error']:.4f} plain SVD "
                    f"(sqrt E||(W - W_up W_down) h||^2 / E||W h||^2, {c['rows']} hidden states)",
                )
            )
        rows += [
            ("dtype source / factors", f"{self.source_dtype} / {self.factor_dtype}"),
            ("full_vocab", f"{self.full_vocab} (+{self.target_rows_added} target rows)"),
            ("d2t / t2d", self.vocab_maps),
            (
                "head is embedding",
                {
                    True: "yes (--rerank serves it)",
                    False: "no (--rerank refused)",
                    None: "unknown (no --target)",
                }[self.head_is_embedding],
            ),
            ("seconds", f"{self.seconds:.2f}"),
        ]
        rows += [
            ("head vs target", ", ".join(f"{k}={v:.4f}" for k, v in self.head_vs_target.items()))
        ] * bool(self.head_vs_target)
        rows += [("note", n) for n in self.notes]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)
