"""Draft-vocabulary maps ``d2t`` / ``t2d`` (pure; EAGLE-3 layout, eagle3-formats.md section 4).

``d2t`` is an int64 [V_d] *offset* table: ``target_id = draft_id + d2t[draft_id]``. ``t2d`` is a bool
[V_t] mask of the target ids covered by the draft vocabulary.
"""

from __future__ import annotations

import torch
from torch import Tensor


class VocabMapError(ValueError):
    """A d2t / t2d pair that is inconsistent; the message names the field and the fix."""


def draft_to_target_ids(d2t: Tensor) -> Tensor:
    """Absolute target ids of each draft row.

    Args:
        d2t: [V_d] int offsets.

    Returns:
        [V_d] int64, ``arange(V_d) + d2t``.
    """
    return torch.arange(d2t.numel(), dtype=torch.int64, device=d2t.device) + d2t.to(torch.int64)


def t2d_from_d2t(d2t: Tensor, vocab_size: int) -> Tensor:
    """Rebuild the bool [V_t] membership mask from offsets (ModelOpt ships no ``t2d``)."""
    mask = torch.zeros(vocab_size, dtype=torch.bool, device=d2t.device)
    mask[draft_to_target_ids(d2t)] = True
    return mask


def d2t_from_target_ids(target_ids: Tensor) -> Tensor:
    """Offsets for a set of kept target ids (sorted ascending first, as EAGLE and SpecForge do).

    Args:
        target_ids: [V_d] distinct int target ids, any order.

    Returns:
        [V_d] int64 offsets, non-decreasing and >= 0.

    Raises:
        VocabMapError: if ids repeat.
    """
    ids = torch.sort(target_ids.to(torch.int64)).values
    if ids.numel() > 1 and bool((ids[1:] == ids[:-1]).any()):
        raise VocabMapError("kept target ids contain duplicates")
    return ids - torch.arange(ids.numel(), dtype=torch.int64)


def validate_vocab_maps(
    d2t: Tensor | None, t2d: Tensor | None, draft_vocab_size: int, vocab_size: int, where: str = "checkpoint"
) -> None:
    """Check the EAGLE-3 consistency rules; raise naming the broken one.

    Rules: ``len(d2t) == V_d``; every target id in [0, V_t); no target id hit twice;
    ``t2d`` is [V_t] bool with ``t2d.sum() == V_d`` and ``nonzero(t2d) == sorted(arange + d2t)``.

    Args:
        d2t: [V_d] int offsets, or None (allowed only if V_d == V_t).
        t2d: [V_t] bool, or None.
        draft_vocab_size: V_d.
        vocab_size: V_t.
        where: file name used in messages.

    Raises:
        VocabMapError: on any broken rule.
    """
    if d2t is None:
        if draft_vocab_size < vocab_size:
            raise VocabMapError(
                f"{where}: draft_vocab_size={draft_vocab_size} < vocab_size={vocab_size} "
                "but no 'd2t' tensor; "
                "a trimmed head without d2t would silently map draft id i to target id i. "
                "Add the d2t offsets (e.g. with `slimspec trim`)."
            )
        if t2d is not None and int(t2d.sum()) != vocab_size:
            raise VocabMapError(
                f"{where}: 't2d' marks {int(t2d.sum())} ids but there is no d2t and V_d == V_t"
            )
        return
    if d2t.dim() != 1 or d2t.numel() != draft_vocab_size:
        raise VocabMapError(
            f"{where}: 'd2t' has shape {tuple(d2t.shape)}, expected [draft_vocab_size={draft_vocab_size}]"
        )
    if d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
        raise VocabMapError(f"{where}: 'd2t' has dtype {d2t.dtype}, expected an integer type (int64)")
    ids = draft_to_target_ids(d2t)
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise VocabMapError(
            f"{where}: 'd2t' maps to target ids in [{int(ids.min())}, {int(ids.max())}], outside "
            f"[0, vocab_size={vocab_size}); is it an absolute id table rather than offsets?"
        )
    uniq = torch.unique(ids)
    if uniq.numel() != ids.numel():
        raise VocabMapError(
            f"{where}: 'd2t' maps {ids.numel() - uniq.numel()} draft ids onto a target id already used"
        )
    if t2d is not None:
        if t2d.dim() != 1 or t2d.numel() != vocab_size:
            raise VocabMapError(
                f"{where}: 't2d' has shape {tuple(t2d.shape)}, expected [vocab_size={vocab_size}]"
            )
        if t2d.dtype != torch.bool:
            raise VocabMapError(f"{where}: 't2d' has dtype {t2d.dtype}, expected bool")
        if int(t2d.sum()) != draft_vocab_size:
            raise VocabMapError(f"{where}: t2d.sum()={int(t2d.sum())} != draft_vocab_size={draft_vocab_size}")
        if not torch.equal(torch.nonzero(t2d).flatten(), uniq):
            raise VocabMapError(f"{where}: 't2d' and 'd2t' disagree on which target ids are drafted")


def trimmed_vocab_from_counts(counts: Tensor, draft_vocab_size: int) -> tuple[Tensor, Tensor]:
    """Static vocabulary trimming (FR-Spec / VocabTrim / SpecForge style): keep the most frequent ids.

    Ties are broken by the lower id; when fewer than V_d ids were seen, unseen ids are added in
    ascending order (SpecForge pads from range(V_d)).

    Args:
        counts: [V_t] token counts (int or float).
        draft_vocab_size: V_d.

    Returns:
        (d2t [V_d] int64 offsets, t2d [V_t] bool).

    Raises:
        ValueError: if V_d is outside [1, V_t].
    """
    vocab_size = counts.numel()
    if not 1 <= draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size={draft_vocab_size} outside [1, vocab_size={vocab_size}]")
    # Stable sort on -count keeps ascending id order among ties.
    order = torch.sort(-counts.to(torch.float64), stable=True).indices
    kept = order[:draft_vocab_size]
    d2t = d2t_from_target_ids(kept)
    return d2t, t2d_from_d2t(d2t, vocab_size)


def scatter_to_target_vocab(draft_logits: Tensor, d2t: Tensor | None, vocab_size: int) -> Tensor:
    """Place draft-vocab logits into a full-vocab row filled with -inf (vLLM ``compute_logits``).

    Args:
        draft_logits: [..., V_d].
        d2t: [V_d] offsets, or None when V_d == V_t.
        vocab_size: V_t.

    Returns:
        [..., V_t] same dtype; -inf for target ids outside the draft vocabulary.
    """
    if d2t is None:
        return draft_logits
    out = draft_logits.new_full((*draft_logits.shape[:-1], vocab_size), float("-inf"))
    out[..., draft_to_target_ids(d2t)] = draft_logits
    return out
