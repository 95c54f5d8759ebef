"""What a training run returns and writes to ``OUT/finetune_report.json``: metrics before and at the kept
checkpoint, the selection and (on-policy runs) the measured tau, with a readable summary."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TrainResult:
    """Summary of a run (also written to ``OUT/finetune_report.json``)."""

    out_dir: str
    steps: int
    losses: list[float]
    history: list[dict[str, Any]]
    before: dict[str, Any]
    best: dict[str, Any]
    tokens_per_s: float
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return {
            k: getattr(self, k)
            for k in (
                "out_dir",
                "steps",
                "losses",
                "history",
                "before",
                "best",
                "tokens_per_s",
                "seconds",
                "extra",
            )
        }

    def summary(self) -> str:
        """A short readable table of before/after held-out metrics."""
        lines = ["metric                      before    best", "-" * 44]
        for key in ("score", "acceptance", "top1"):
            b, a = self.before.get(key), self.best.get(key)
            if isinstance(b, list):
                for s, (x, y) in enumerate(zip(b, a, strict=False)):
                    lines.append(f"{key}[step {s}]".ljust(26) + f"{x:8.4f}  {y:8.4f}")
            elif b is not None:
                lines.append(key.ljust(26) + f"{b:8.4f}  {a:8.4f}")
        lines.append(
            f"best step {self.best.get('step')}, {self.steps} steps, "
            f"{self.tokens_per_s:.0f} training tokens/s, {self.seconds:.0f} s"
        )
        sel = self.extra.get("selection")
        if sel and sel.get("gain") is not None:
            verdict = "improved on" if sel["improved"] else "kept"
            lines.append(
                f"selected by {sel['score_kind']}: {verdict} the initial drafter "
                f"({sel['initial_score']:.4f} -> {sel['kept_score']:.4f}, {sel['gain']:+.4f})"
            )
        meas = self.extra.get("measured")
        if meas:
            lines.append(
                f"measured greedy chain-{meas['depth']} tau on {meas['num_prompts']} held-out prompts: "
                f"initial {meas['initial_tau']:.3f}, kept {meas['kept_tau']:.3f}"
            )
        return "\n".join(lines)
