"""Drafter folders on disk: ``config.json``, single or sharded weight files (safetensors or pickled
``pytorch_model.bin``, read with ``weights_only=True``), as zero-copy tensor references."""

from __future__ import annotations

import json
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from slimspec_convert.checkpoint.names import (
    BIN_INDEX_NAME,
    BIN_NAME,
    CONFIG_NAME,
    SAFETENSORS_INDEX_NAME,
    WEIGHTS_NAME,
)
from slimspec_convert.checkpoint.weightfiles import (  # noqa: F401
    CheckpointError,
    TensorRef,
    read_safetensors_header,
    write_safetensors,
)


def read_config(path: Path) -> dict[str, Any]:
    """Parse ``path/config.json``.

    Raises:
        CheckpointError: missing or invalid JSON.
    """
    f = path / CONFIG_NAME
    if not f.is_file():
        raise CheckpointError(f"{f}: missing; a drafter folder needs config.json")
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{f}: invalid JSON ({e})") from e


def _load_bin(path: Path) -> dict[str, TensorRef]:
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except (RuntimeError, pickle.UnpicklingError, EOFError, ValueError, OSError) as e:
        raise CheckpointError(
            f"{path}: cannot be read as a PyTorch checkpoint with weights_only=True ({e})"
        ) from e
    if not isinstance(obj, dict) or not all(isinstance(v, Tensor) for v in obj.values()):
        raise CheckpointError(f"{path}: expected a flat state dict of tensors, got {type(obj).__name__}")
    return {k: TensorRef(path, k, v.dtype, tuple(v.shape), value=v) for k, v in obj.items()}


def _read_index(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"{index}: invalid index file, expected a JSON object with 'weight_map' ({e})"
        ) from e
    shards = sorted(set(weight_map.values()))
    for shard in shards:
        if not (index.parent / shard).is_file():
            raise CheckpointError(
                f"{index}: 'weight_map' names shard {shard!r}, which is missing from the folder"
            )
    return [index.parent / s for s in shards]


def open_weights(folder: str | Path) -> tuple[dict[str, TensorRef], list[Path]]:
    """Every tensor of a checkpoint folder, without reading the data.

    Looks for, in order: ``model.safetensors.index.json`` (sharded), ``model.safetensors``,
    ``pytorch_model.bin.index.json``, ``pytorch_model.bin`` (``torch.load(weights_only=True)``,
    memory-mapped when the file is a zip archive).

    Args:
        folder: checkpoint folder.

    Returns:
        ({key: TensorRef}, files read).

    Raises:
        CheckpointError: no weight file, a missing shard, a corrupt file, or a key in two shards.
        FileNotFoundError: ``folder`` does not exist.
    """
    p = Path(folder)
    if not p.is_dir():
        raise FileNotFoundError(f"{p}: no such checkpoint folder")
    if (p / SAFETENSORS_INDEX_NAME).is_file():
        files, reader = _read_index(p / SAFETENSORS_INDEX_NAME), read_safetensors_header
    elif (p / WEIGHTS_NAME).is_file():
        files, reader = [p / WEIGHTS_NAME], read_safetensors_header
    elif (p / BIN_INDEX_NAME).is_file():
        files, reader = _read_index(p / BIN_INDEX_NAME), _load_bin
    elif (p / BIN_NAME).is_file():
        files, reader = [p / BIN_NAME], _load_bin
    else:
        raise CheckpointError(
            f"{p}: no {WEIGHTS_NAME}, {SAFETENSORS_INDEX_NAME}, {BIN_NAME} or {BIN_INDEX_NAME} in the folder"
        )
    refs: dict[str, TensorRef] = {}
    for f in files:
        for k, ref in reader(f).items():
            if k in refs:
                raise CheckpointError(f"{f}: tensor '{k}' is also in {refs[k].file}; shards must not overlap")
            refs[k] = ref
    return refs, files
