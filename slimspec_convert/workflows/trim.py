"""Static vocabulary trimming, the baseline SlimSpec is compared with (FR-Spec / VocabTrim / EAGLE-3 style).

Count target-token frequencies on a calibration file, keep the N most frequent target ids, build
``d2t`` (offsets) / ``t2d`` (bool mask) in the EAGLE-3 layout, and slice the drafter's lm_head rows.
A token outside the kept set can never be drafted (the paper, arXiv 2605.10453: "Vocabulary trimming
... caps acceptance").

Counting follows the training-data convention: where a record has responses, only the assistant
tokens of the chat-template rendering count (the tokens a drafter must predict); prompt-only records
(bare strings, MT-Bench ``turns``) count every token of their text. Record formats are those of
``slimspec_convert.data``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor

from slimspec_convert.atomic import claim_folder, staged_folder
from slimspec_convert.checkpoint.load import load_drafter_with_target_embeddings
from slimspec_convert.checkpoint.names import (
    D2T_KEY,
    LM_HEAD_KEY,
    LM_HEAD_UP_KEY,
    T2D_KEY,
)
from slimspec_convert.checkpoint.save import save_drafter
from slimspec_convert.data.examples import encode_conversation
from slimspec_convert.data.records import has_assistant, read_conversations
from slimspec_convert.dtypes import DTYPES, check_dtype_name
from slimspec_convert.model.drafter import Eagle3Drafter
from slimspec_convert.model.head import LowRankHead
from slimspec_convert.model.vocab import draft_to_target_ids, trimmed_vocab_from_counts
from slimspec_convert.targets.load import load_tokenizer
from slimspec_convert.version import __version__

DEFAULT_TRIM_MAX_LENGTH = 2048


@dataclass(frozen=True)
class TrimConfig:
    """Options of ``slimspec trim``: keep the ``draft_vocab_size`` most frequent target tokens."""

    draft_vocab_size: int
    data: tuple[str, ...]
    target: str
    max_length: int = DEFAULT_TRIM_MAX_LENGTH
    dtype: str | None = None
    force: bool = False

    def __post_init__(self) -> None:
        if self.draft_vocab_size < 1:
            raise ValueError(f"TrimConfig.draft_vocab_size={self.draft_vocab_size}: expected >= 1")
        if not self.data:
            raise ValueError("TrimConfig.data is empty: give a calibration file (--data)")
        if self.max_length < 2:
            raise ValueError(f"TrimConfig.max_length={self.max_length}: expected >= 2")
        if self.dtype is not None:
            check_dtype_name("TrimConfig", self.dtype)


@dataclass
class CalibrationCounts:
    """Target-token counts of a calibration file.

    Attributes:
        counts: [V_t] int64 occurrences of each target id.
        num_conversations: conversations read.
        num_prompt_only: of those, without an assistant turn (all their text tokens counted).
        num_tokens: counted tokens (= counts.sum()).
    """

    counts: Tensor
    num_conversations: int
    num_prompt_only: int
    num_tokens: int


def count_calibration_tokens(
    paths: list[str | Path], tokenizer, vocab_size: int, max_length: int
) -> CalibrationCounts:
    """Count target-token frequencies of calibration files.

    Args:
        paths: JSONL/JSON files in any format ``slimspec_convert.data`` reads.
        tokenizer: the target's tokenizer (fast, with a chat template for conversations).
        vocab_size: V_t; every token id must be below it.
        max_length: tokens kept per conversation (longer ones are truncated).

    Returns:
        :class:`CalibrationCounts`.

    Raises:
        FileNotFoundError: a missing file.
        ValueError: malformed data (file:line in the message), a token id >= V_t, or nothing counted.
    """

    counts = torch.zeros(vocab_size, dtype=torch.int64)
    convs = read_conversations(list(paths))
    prompt_only = 0
    for conv in convs:
        if has_assistant(conv):
            enc = encode_conversation(tokenizer, conv, max_length)
            if enc is None:
                continue
            ids, mask, _ = enc
            ids = ids[mask]  # assistant tokens only
        else:
            prompt_only += 1
            text = "\n".join(m["content"] for m in conv)
            ids = torch.tensor(
                tokenizer(text, add_special_tokens=False)["input_ids"][:max_length], dtype=torch.int64
            )
        if ids.numel() and int(ids.max()) >= vocab_size:
            raise ValueError(
                f"tokenizer produced id {int(ids.max())} >= vocab_size={vocab_size} of the drafter; "
                "is --target the drafter's target?"
            )
        counts += torch.bincount(ids, minlength=vocab_size)
    total = int(counts.sum())
    if total == 0:
        raise ValueError(f"{[str(p) for p in paths]}: no tokens counted; is the calibration file empty?")
    return CalibrationCounts(counts, len(convs), prompt_only, total)


def trim_drafter(drafter: Eagle3Drafter, counts: Tensor, draft_vocab_size: int) -> Eagle3Drafter:
    """A copy of ``drafter`` whose head keeps only the ``draft_vocab_size`` most frequent target ids.

    Ties go to the lower target id; unseen ids fill up in ascending order
    (:func:`~slimspec_convert.model.vocab.trimmed_vocab_from_counts`). A drafter that is already trimmed
    can be trimmed further (only ids it covers can be kept); a low-rank head keeps ``W_down`` and
    slices ``W_up``. Row i of the new head is the old head's row for target id ``i + d2t[i]``.

    Args:
        drafter: source drafter (dense or low-rank head, full or trimmed vocabulary).
        counts: [V_t] token counts (int or float).
        draft_vocab_size: N, kept rows.

    Returns:
        A new drafter (same dtype) with ``draft_vocab_size = N`` and ``d2t`` / ``t2d`` buffers.

    Raises:
        ValueError: counts of the wrong length, or N outside [1, rows of the source head].
    """
    cfg = drafter.config
    if counts.dim() != 1 or counts.numel() != cfg.vocab_size:
        raise ValueError(f"counts has shape {tuple(counts.shape)}, expected [vocab_size={cfg.vocab_size}]")
    if not 1 <= draft_vocab_size <= cfg.draft_vocab_size:
        raise ValueError(
            f"draft_vocab_size={draft_vocab_size} outside [1, {cfg.draft_vocab_size}] (source head rows)"
        )
    src_ids = draft_to_target_ids(drafter.d2t) if drafter.d2t is not None else None
    scores = counts.to(torch.float64)
    if src_ids is not None:  # only ids the source head covers may be kept: -1 sorts them after unseen ids
        covered = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        covered[src_ids] = True
        scores = torch.where(covered, scores, torch.full_like(scores, -1.0))
    d2t, t2d = trimmed_vocab_from_counts(scores, draft_vocab_size)
    kept = draft_to_target_ids(d2t)  # [N] target ids, ascending
    if src_ids is None:
        rows = kept
    else:
        row_of = torch.full((cfg.vocab_size,), -1, dtype=torch.int64)
        row_of[src_ids] = torch.arange(src_ids.numel())
        rows = row_of[kept]  # [N] source head rows
        assert bool((rows >= 0).all()), "kept an id the source head does not cover"
    new = Eagle3Drafter(cfg.replace(draft_vocab_size=draft_vocab_size))
    dtype = next(p.dtype for p in drafter.parameters() if p.is_floating_point())
    new.to(dtype)
    state = {k: v for k, v in drafter.state_dict().items() if k not in (D2T_KEY, T2D_KEY)}
    head = drafter.lm_head
    if isinstance(head, LowRankHead):
        state[LM_HEAD_UP_KEY] = head.up.weight.detach()[rows].clone()  # [N, r]
    else:
        state[LM_HEAD_KEY] = head.weight.detach()[rows].clone()  # [N, d]
    if new.d2t is not None:
        state[D2T_KEY], state[T2D_KEY] = d2t, t2d
    new.load_state_dict(state, strict=True)
    return new.eval()


@dataclass
class TrimReport:
    """What ``trim_checkpoint`` did.

    Attributes:
        out: output folder.
        vocab_size: V_t.
        draft_vocab_size: N.
        source_draft_vocab_size: rows of the source head.
        num_conversations, num_prompt_only, num_tokens: calibration counts.
        coverage: fraction of calibration tokens whose id is kept (an upper bound on greedy
            acceptance on that text).
    """

    out: str
    vocab_size: int
    draft_vocab_size: int
    source_draft_vocab_size: int
    num_conversations: int
    num_prompt_only: int
    num_tokens: int
    coverage: float

    def to_dict(self) -> dict:
        """JSON-ready dict."""
        return asdict(self)

    def summary(self) -> str:
        """One line for the CLI."""
        return (
            f"trimmed {self.source_draft_vocab_size} -> {self.draft_vocab_size} rows "
            f"(V_t={self.vocab_size}); "
            f"kept ids cover {100 * self.coverage:.2f}% of {self.num_tokens} calibration tokens "
            f"({self.num_conversations} conversations, {self.num_prompt_only} prompt-only); wrote {self.out}"
        )


def trim_checkpoint(src: str | Path, out: str | Path, cfg: TrimConfig) -> TrimReport:
    """``slimspec trim``: count calibration tokens, trim the drafter, write it (with its embeddings).

    Args:
        src: SlimSpec-native drafter folder.
        out: output folder, built beside and put in place when complete (refused if it exists and is
            not empty, unless ``cfg.force``; an existing OUT is replaced only at the end).
        cfg: :class:`~slimspec_convert.workflows.trim.TrimConfig`.

    Returns:
        :class:`TrimReport`.

    Raises:
        FileExistsError: ``out`` exists, is not empty and force is off; ``out`` is a link or a file.
        OSError: OUT cannot be written (naming it; see docs/faults.md).
        FileNotFoundError: missing source, target or data.
        ValueError: bad data, sizes or checkpoint (:class:`CheckpointError` is a ValueError).
    """
    out = Path(out)
    # an existing empty folder (made for the result) is free; anything else needs --force
    force = cfg.force or (out.is_dir() and not out.is_symlink() and not any(out.iterdir()))
    # OUT is locked from this check to the swap; a link or a read-only OUT fails now, before the work
    with claim_folder(out, force):
        drafter = load_drafter_with_target_embeddings(src, cfg.target)
        tokenizer = load_tokenizer(cfg.target)
        calib = count_calibration_tokens(list(cfg.data), tokenizer, drafter.config.vocab_size, cfg.max_length)
        trimmed = trim_drafter(drafter, calib.counts, cfg.draft_vocab_size)
        kept = (
            draft_to_target_ids(trimmed.d2t)
            if trimmed.d2t is not None
            else torch.arange(calib.counts.numel())
        )
        coverage = float(calib.counts[kept].sum()) / calib.num_tokens
        report = TrimReport(
            str(out),
            drafter.config.vocab_size,
            cfg.draft_vocab_size,
            drafter.config.draft_vocab_size,
            calib.num_conversations,
            calib.num_prompt_only,
            calib.num_tokens,
            coverage,
        )
        meta = {"trim": {"config": asdict(cfg), "report": report.to_dict(), "version": __version__}}
        with staged_folder(out, force) as tmp:
            save_drafter(
                trimmed,
                tmp,
                dtype=getattr(torch, DTYPES[cfg.dtype]) if cfg.dtype else None,
                include_embeddings=True,
                extra_config=meta,
            )
        return report
