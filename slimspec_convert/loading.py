"""Build an :class:`~slimspec_convert.drafter.Eagle3Drafter` from any EAGLE-3 layout (I/O layer API).

``load_drafter`` and ``inspect_drafter`` (re-exported by :mod:`slimspec_convert.convert`) read what
:func:`~slimspec_convert.dialects.resolve_checkpoint` mapped, and borrow from the target what the
file lacks, saying so in the :class:`~slimspec_convert.canonical.LoadReport`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from .canonical import LoadReport, ResolvedCheckpoint
from .checkpoint import (
    D2T_KEY,
    EMBED_KEY,
    LM_HEAD_DOWN_KEY,
    LM_HEAD_KEY,
    LM_HEAD_UP_KEY,
    TARGET_EMBED_KEYS,
    TARGET_HEAD_KEY,
    CheckpointError,
    build_drafter,
    open_weights,
    read_config,
)
from .dialects import expected_shapes, resolve_checkpoint
from .drafter import Eagle3Drafter
from .factorize import count_nonfinite
from .vocab import draft_to_target_ids


@dataclass
class TargetTensors:
    """What the converter needs from a target: its embedding, lm_head and depth, read lazily.

    Build with :meth:`open`. A folder is read through its weight-file headers (the head is a
    memory-mapped view, the model is never instantiated); a loaded HF model is used as is.
    """

    description: str
    num_layers: int | None
    _embed: Any
    _head: Any

    @classmethod
    def open(cls, target: str | Path | nn.Module) -> TargetTensors:
        """From an HF folder, a ``.gguf`` file (loaded through transformers) or a loaded HF model.

        Raises:
            FileNotFoundError: no such folder.
            CheckpointError: no embedding table in the target's weights.
        """
        if isinstance(target, nn.Module):
            return cls(
                type(target).__name__,
                getattr(target.config, "num_hidden_layers", None),
                lambda: target.get_input_embeddings().weight.detach(),
                lambda: target.get_output_embeddings().weight.detach(),
            )
        p = Path(target)
        if p.suffix == ".gguf":
            from .target import load_target

            model, _ = load_target(p)
            return cls.open(model)
        if not p.is_dir():
            raise FileNotFoundError(f"{p}: target folder not found (a hub id must be downloaded first)")
        config = read_config(p)
        refs, _ = open_weights(p)
        embed_key = next((k for k in TARGET_EMBED_KEYS if k in refs), None)
        if embed_key is None:
            raise CheckpointError(f"{p}: no {' or '.join(TARGET_EMBED_KEYS)} in the target's weights")
        head_ref = refs.get(TARGET_HEAD_KEY, refs[embed_key])  # tied embeddings share the table
        return cls(str(p), config.get("num_hidden_layers"), refs[embed_key].view, head_ref.view)

    def embed(self) -> Tensor:
        """[V_t, dt] input embedding (zero-copy where possible; do not modify)."""
        return self._embed()

    def head(self) -> Tensor:
        """[V_t, dt] lm_head weight (zero-copy where possible; do not modify)."""
        return self._head()


def load_drafter(
    path: str | Path, target: str | Path | nn.Module | None = None, *, norm_output_semantics: str = "auto"
) -> tuple[Eagle3Drafter, LoadReport]:
    """Build a drafter from any published EAGLE-3 layout, strictly.

    Every parameter is read from the file, or borrowed from the target when the file lacks it
    (``embed_tokens.weight``: every trainer freezes it to the target's table, eagle3-formats.md
    section 5; ``lm_head.weight`` of head-less drafters that engines run with the target head);
    the report lists which.

    Args:
        path: checkpoint folder (any dialect in :mod:`slimspec_convert.dialects`).
        target: HF folder, ``.gguf`` file or loaded HF model to borrow from; needed when the file
            has no embedding (EAGLE, SpecForge >= 2025-08, ModelOpt).
        norm_output_semantics: see :func:`~slimspec_convert.dialects.resolve_checkpoint`.

    Returns:
        (drafter with parameters in the stored float dtype (float32 if mixed), :class:`LoadReport`).

    Raises:
        CheckpointError: bad layout, tensors or vocab maps (see ``resolve_checkpoint``); NaN/inf
            in a tensor; nothing to borrow from; a borrowed table of the wrong shape.
        FileNotFoundError: missing folder.
    """
    tgt = TargetTensors.open(target) if target is not None else None
    res = resolve_checkpoint(
        path, target_num_layers=tgt.num_layers if tgt else None, norm_output_semantics=norm_output_semantics
    )
    state = {}
    for k, ct in res.tensors.items():
        t = ct.load()
        if t.is_floating_point() and (bad := count_nonfinite(t)):
            raise CheckpointError(f"{ct.origin} has {bad} NaN/inf entries")
        state[k] = t
    for key in borrowed_keys(res):
        state[key] = borrow(key, res, tgt)
    where = ", ".join(res.report.files)
    return build_drafter(res.config, state, embed_from=None, where=where), res.report


def inspect_drafter(
    path: str | Path, target: str | Path | nn.Module | None = None, *, norm_output_semantics: str = "auto"
) -> LoadReport:
    """Describe a drafter checkpoint without building it: layout, geometry, flags, vocab, provenance.

    Validates what :func:`load_drafter` validates (keys, shapes, vocab maps, NaN/inf in the head)
    but reads only headers, the vocab maps and the head (in row blocks).

    Args:
        path: checkpoint folder.
        target: optional; only used to read the target depth (aux-id conventions).
        norm_output_semantics: see :func:`~slimspec_convert.dialects.resolve_checkpoint`.

    Returns:
        :class:`LoadReport`.

    Raises:
        CheckpointError: as :func:`load_drafter`.
        FileNotFoundError: missing folder.
    """
    tgt = TargetTensors.open(target) if target is not None else None
    res = resolve_checkpoint(
        path, target_num_layers=tgt.num_layers if tgt else None, norm_output_semantics=norm_output_semantics
    )
    for key in (LM_HEAD_KEY, LM_HEAD_UP_KEY, LM_HEAD_DOWN_KEY):
        if key in res.tensors and (bad := count_nonfinite(res.tensors[key].view())):
            raise CheckpointError(f"{res.tensors[key].origin} has {bad} NaN/inf entries")
    for key in borrowed_keys(res):
        res.report.tensors[key] = "needs the target (not in the file)"
        res.report.warnings.append(f"'{key}' is not in the file: load_drafter borrows it from the target")
    return res.report


def borrowed_keys(res: ResolvedCheckpoint) -> list[str]:
    """Canonical keys the file lacks and the target must supply."""
    keys = [EMBED_KEY] if EMBED_KEY not in res.tensors else []
    return keys + ([LM_HEAD_KEY] if res.head_missing else [])


def borrow(key: str, res: ResolvedCheckpoint, tgt: TargetTensors | None) -> Tensor:
    """``embed_tokens`` or ``lm_head`` from the target, checked against the drafter's shapes.

    A trimmed drafter without a head gets the target rows ``i + d2t[i]``. The report records it.

    Raises:
        CheckpointError: no target given, or its table has the wrong shape.
    """
    cfg = res.config
    if tgt is None:
        raise CheckpointError(
            f"{', '.join(res.report.files)}: no '{key}' in the file; pass the target (--target) to borrow it"
        )
    if key == EMBED_KEY:
        t = tgt.embed()
    else:
        t = tgt.head()
        if cfg.is_trimmed:
            t = t[draft_to_target_ids(res.tensors[D2T_KEY].load())]  # rows i + d2t[i]
    want = expected_shapes(cfg)[key][0]
    if tuple(t.shape) != want:
        raise CheckpointError(
            f"target {tgt.description}: its table has shape {list(t.shape)}, the drafter needs "
            f"'{key}' {list(want)} (target hidden size != drafter hidden size?)"
        )
    res.report.borrowed.append(key)
    res.report.tensors[key] = f"borrowed from target {tgt.description}"
    return t
