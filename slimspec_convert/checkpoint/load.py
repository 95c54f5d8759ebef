"""Loading a drafter of any published layout into an :class:`~slimspec_convert.model.drafter.Eagle3Drafter`
(strictly, every tensor checked), borrowing what the file lacks (``embed_tokens``) from the target."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import Tensor, nn

from slimspec_convert.checkpoint.canonical import LoadReport, ResolvedCheckpoint
from slimspec_convert.checkpoint.dialects import expected_shapes, resolve_checkpoint
from slimspec_convert.checkpoint.folders import open_weights, read_config
from slimspec_convert.checkpoint.names import (
    CONFIG_NAME,
    D2T_KEY,
    EMBED_KEY,
    FC_KEY,
    LM_HEAD_KEY,
    MIDLAYER_PREFIX,
    SLIMSPEC_SECTION,
    TARGET_EMBED_KEYS,
    TARGET_HEAD_KEY,
    WEIGHTS_NAME,
)
from slimspec_convert.checkpoint.weightfiles import (  # noqa: F401
    CheckpointError,
    TensorRef,
    read_safetensors_header,
    write_safetensors,
)
from slimspec_convert.lowrank.blocks import count_nonfinite
from slimspec_convert.model.config import DrafterConfig
from slimspec_convert.model.drafter import Eagle3Drafter
from slimspec_convert.model.vocab import draft_to_target_ids
from slimspec_convert.targets.load import check_target_folder, load_target, not_a_drafter


def load_native(path: str | Path, embed_from: Tensor | None = None) -> Eagle3Drafter:
    """Load a folder written by :func:`save_drafter` (strict: every key must match).

    Args:
        path: folder.
        embed_from: [V_t, d] table to borrow when the file has no ``embed_tokens.weight``.

    Returns:
        The drafter (parameters in the stored dtype).

    Raises:
        CheckpointError: missing config section, missing/extra/mis-shaped tensors, a lost own
            ``embed_tokens``, NaN/inf.
    """
    p = Path(path)
    raw = read_config(p)
    if SLIMSPEC_SECTION not in raw:
        raise CheckpointError(f"{p / CONFIG_NAME}: no 'slimspec' section; not a SlimSpec-native drafter")
    cfg = DrafterConfig.from_dict(raw[SLIMSPEC_SECTION]["drafter_config"])
    state = load_file(str(p / WEIGHTS_NAME))
    if cfg.own_embeddings and EMBED_KEY not in state:
        raise CheckpointError(f"{p / WEIGHTS_NAME}: no '{EMBED_KEY}' though the drafter ships its own table")
    for key, t in state.items():
        if t.is_floating_point() and t.dim() and (bad := count_nonfinite(t)):
            raise CheckpointError(f"{p / WEIGHTS_NAME}: '{key}' has {bad} NaN/inf entries")
    return build_drafter(cfg, state, embed_from=embed_from, where=str(p / WEIGHTS_NAME))


def build_drafter(
    cfg: DrafterConfig, state: dict[str, Tensor], *, embed_from: Tensor | None, where: str
) -> Eagle3Drafter:
    """Build a drafter from a canonical state dict, strictly.

    Raises:
        CheckpointError: on a missing, unexpected or mis-shaped tensor.
    """
    drafter = Eagle3Drafter(cfg)
    expected = {k: v for k, v in drafter.state_dict().items() if not k.startswith("rotary_emb.")}
    state = dict(state)
    if EMBED_KEY not in state:
        if embed_from is None:
            raise CheckpointError(
                f"{where}: no '{EMBED_KEY}' in the file and no target to borrow it from; pass the target"
            )
        state[EMBED_KEY] = embed_from.detach()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{where}: missing tensors {missing}, unexpected tensors {unexpected}")
    for k, v in expected.items():
        if tuple(state[k].shape) != tuple(v.shape):
            raise CheckpointError(
                f"{where}: '{k}' has shape {tuple(state[k].shape)}, expected {tuple(v.shape)} "
                "from config.json"
            )
    float_dtypes = {t.dtype for k, t in state.items() if t.is_floating_point() and k != EMBED_KEY}
    dtype = float_dtypes.pop() if len(float_dtypes) == 1 else torch.float32
    drafter.to(dtype)
    state[EMBED_KEY] = state[EMBED_KEY].to(dtype)
    if D2T_KEY in state:
        state[D2T_KEY] = state[D2T_KEY].to(torch.int64)
    drafter.load_state_dict(state, strict=True)
    return drafter


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
            FileNotFoundError: no such folder, or no config.json.
            TargetError: not a target (invalid config.json, no weights, a drafter's config or tensors).
            CheckpointError: corrupt weight files, no embedding table in the target's weights.
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
            model, _ = load_target(p)
            return cls.open(model)
        if not p.is_dir():
            raise FileNotFoundError(f"{p}: target folder not found (a hub id must be downloaded first)")
        config = check_target_folder(p)
        refs, _ = open_weights(p)
        drafter_keys = [k for k in refs if k == FC_KEY or k.startswith(MIDLAYER_PREFIX)]
        not_a_drafter(p, f"tensors {drafter_keys[:2]}" if drafter_keys else None)
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
        path: checkpoint folder (any dialect in :mod:`slimspec_convert.checkpoint.dialects`).
        target: HF folder, ``.gguf`` file or loaded HF model to borrow from; needed when the file
            has no embedding (EAGLE, SpecForge >= 2025-08, ModelOpt).
        norm_output_semantics: see :func:`~slimspec_convert.checkpoint.dialects.resolve_checkpoint`.

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
    state = {k: ct.load() for k, ct in res.tensors.items()}  # every float tensor checked finite by resolve
    for key in borrowed_keys(res):
        state[key] = borrow(key, res, tgt)
    where = ", ".join(res.report.files)
    return build_drafter(res.config, state, embed_from=None, where=where), res.report


def inspect_drafter(
    path: str | Path, target: str | Path | nn.Module | None = None, *, norm_output_semantics: str = "auto"
) -> LoadReport:
    """Describe a drafter checkpoint without building it: layout, geometry, flags, vocab, provenance.

    Validates what :func:`load_drafter` validates (keys, shapes, vocab maps, NaN/inf in any float
    tensor) but reads only headers, the vocab maps and each float tensor once in row blocks.

    Args:
        path: checkpoint folder.
        target: optional; only used to read the target depth (aux-id conventions).
        norm_output_semantics: see :func:`~slimspec_convert.checkpoint.dialects.resolve_checkpoint`.

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
    for key in borrowed_keys(res):  # not a fault: engines lend a head-less drafter the target's tensors
        res.report.tensors[key] = "needs the target (not in the file)"
        res.report.borrowed.append(key)
    return res.report


def borrowed_keys(res: ResolvedCheckpoint) -> list[str]:
    """Canonical keys the file lacks and the target must supply."""
    keys = [EMBED_KEY] if EMBED_KEY not in res.tensors else []
    return keys + ([LM_HEAD_KEY] if res.head_missing else [])


def borrow(key: str, res: ResolvedCheckpoint, tgt: TargetTensors | None) -> Tensor:
    """``embed_tokens`` or ``lm_head`` from the target, checked against the drafter's shapes.

    A trimmed drafter without a head gets the target rows ``i + d2t[i]``. The report records it.

    Raises:
        CheckpointError: no target given, or its table has the wrong shape or NaN/inf entries.
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
        raise CheckpointError(f"target {tgt.description}: {_borrow_mismatch(key, tuple(t.shape), want, cfg)}")
    if bad := count_nonfinite(t):
        raise CheckpointError(f"target {tgt.description}: its '{key}' table has {bad} NaN/inf entries")
    res.report.borrowed.append(key)
    res.report.tensors[key] = f"borrowed from target {tgt.description}"
    return t


def _borrow_mismatch(key: str, got: tuple[int, ...], want: tuple[int, ...], cfg) -> str:
    """Which field makes a target's table unfit for the drafter, with both values and the fix."""
    if len(got) != 2 or len(want) != 2:
        return f"its '{key}' table has shape {list(got)}, the drafter needs {list(want)}"
    rows = "draft_vocab_size" if key != EMBED_KEY and cfg.is_trimmed else "vocab_size"
    why = []
    if got[0] != want[0]:
        why.append(
            f"vocab_size differs: the target's config.json vocab_size={got[0]}, the drafter's "
            f"config.json {rows}={want[0]}"
        )
    if got[1] != want[1]:
        why.append(
            f"hidden_size differs: the target's {got[1]}, the drafter's config.json hidden_size={want[1]}"
        )
    fix = (
        "is --target the target this drafter was trained for?"
        if got[0] != want[0]
        else f"the drafter must carry its own '{key}' in its file"
    )
    return f"its '{key}' table has shape {list(got)}, the drafter needs {list(want)}: {'; '.join(why)}; {fix}"


def load_drafter_with_target_embeddings(src: str | Path, target) -> Eagle3Drafter:
    """Load a drafter in any published layout (:func:`slimspec_convert.convert.load_drafter`),
    borrowing ``embed_tokens`` from the target when the file lacks it.

    Args:
        src: drafter folder.
        target: a loaded HF target model, or its path.

    Returns:
        The drafter (stored dtype).

    Raises:
        CheckpointError: unreadable drafter.
        FileNotFoundError: missing folders.
    """

    if not Path(src).is_dir():
        raise FileNotFoundError(f"{src}: drafter folder not found")
    return load_drafter(src, target=target)[0]
