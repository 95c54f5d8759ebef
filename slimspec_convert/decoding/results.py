"""What decoding returns: per-prompt results, per-run statistics and the stage timer of one run."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class StageTimes:
    """Accumulated wall time per stage, in milliseconds."""

    target_ms: float = 0.0
    drafter_backbone_ms: float = 0.0
    drafter_head_ms: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)

    def copy(self) -> StageTimes:
        """A snapshot."""
        return StageTimes(self.target_ms, self.drafter_backbone_ms, self.drafter_head_ms, dict(self.extra))


@dataclass
class GenerationStats:
    """Per-prompt statistics. Times are totals in ms; with batch > 1 they are the batch's, up to
    the round in which this row finished.

    Attributes:
        tau: mean tokens committed per verification round (accepted drafts + 1 bonus; the token
            from the prefill forward is not a round), None when there was no round.
        new_tokens: generated tokens (prefill token included).
        cycles: verification rounds (target forwards after the prefill).
        tokens_per_s: new_tokens / wall time.
        wall_ms: from the batch's start to the end of this row's last round.
        target_ms, drafter_backbone_ms, drafter_head_ms: time inside target forwards, drafter
            backbone (fc, decoder layers, final norm) and drafter lm_head (with the greedy
            chain's pick over its rows).
        overhead_ms: the rest (the loop's own work).
        committed_per_cycle: tokens committed by each round (after stop / budget truncation).
        draft, sampling: the configs used; batch_size: prompts decoded together.
        chat_template: ``sha256:<12 hex>`` of the chat template used, None without one.
        system_prompt: the system message passed (None = the template's default, if any).
        lookup_tokens: accepted drafts that only the prompt lookup proposed (``DraftConfig.lookup``);
            the rest of ``new_tokens`` came from the drafter, the bonus tokens and the prefill's token.
    """

    tau: float | None
    new_tokens: int
    cycles: int
    tokens_per_s: float
    wall_ms: float
    target_ms: float
    drafter_backbone_ms: float
    drafter_head_ms: float
    overhead_ms: float
    committed_per_cycle: list[int]
    draft: dict
    sampling: dict
    batch_size: int
    chat_template: str | None
    system_prompt: str | None
    lookup_tokens: int = 0


@dataclass
class GenerationResult:
    """One prompt's output.

    Attributes:
        prompt: the user text (None when token ids were given).
        prompt_text: the exact text fed to the tokenizer (after the chat template), or None.
        prompt_ids: token ids of the prompt.
        output_ids: new token ids only (a final stop token included, as plain decoding does).
        text: decoded ``output_ids`` (special tokens skipped), None without a tokenizer.
        stats: :class:`GenerationStats`.
    """

    prompt: str | None
    prompt_text: str | None
    prompt_ids: list[int]
    output_ids: list[int]
    text: str | None
    stats: GenerationStats

    def to_dict(self) -> dict:
        """JSON-ready dict: prompt, output_ids, text, stats, prompt_text."""
        return {
            "prompt": self.prompt,
            "output_ids": self.output_ids,
            "text": self.text,
            "stats": asdict(self.stats),
            "prompt_text": self.prompt_text,
        }
