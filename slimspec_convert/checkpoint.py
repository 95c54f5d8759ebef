"""The only module that reads or writes checkpoint files (safetensors, config.json).

Native layout written by SlimSpec (readable by SpecForge / SGLang for dense heads):
``config.json`` (flat ``LlamaForCausalLMEagle3`` config + a ``slimspec`` section holding the
normalised :class:`~slimspec_convert.config.DrafterConfig`) and ``model.safetensors``.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from . import __version__
from .config import AUX_CONVENTION_BOUNDARY, DrafterConfig
from .drafter import Eagle3Drafter
from .weightfiles import CheckpointError, TensorRef, read_safetensors_header, write_safetensors  # noqa: F401

logger = logging.getLogger(__name__)

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
SAFETENSORS_INDEX_NAME = "model.safetensors.index.json"
BIN_NAME = "pytorch_model.bin"
BIN_INDEX_NAME = "pytorch_model.bin.index.json"
REPORT_NAME = "slimspec_report.json"
SLIMSPEC_SECTION = "slimspec"
EMBED_KEY = "embed_tokens.weight"
LM_HEAD_KEY = "lm_head.weight"
LM_HEAD_DOWN_KEY = "lm_head.down.weight"
LM_HEAD_UP_KEY = "lm_head.up.weight"
D2T_KEY = "d2t"
T2D_KEY = "t2d"
FC_KEY = "fc.weight"
FC_BIAS_KEY = "fc.bias"
NORM_KEY = "norm.weight"
INPUT_NORM_KEY = "input_norm.weight"  # norm_before_fc
FC_NORM_PREFIX = "fc_norm."  # fc_norm.{k}.weight
FIRST_LAYER_PREFIX = "midlayer."  # canonical first decoder layer (EAGLE / SpecForge spelling)
EXTRA_LAYER_PREFIX = "extra_layers."  # canonical layers >= 1, as extra_layers.{i-1}.
VLLM_D2T_KEY = "draft_id_to_target_id"
# Layer prefixes of the published dialects (eagle3-formats.md P1, P2): midlayer.* (EAGLE, SpecForge),
# midlayer.{i}.* (old ModelOpt), layers.{i}.* (speculators, ModelOpt), model.layers.{i}.* (vLLM).
LAYER_KEY_RE = re.compile(r"^(?:midlayer\.(\d+)\.|midlayer\.|layers\.(\d+)\.)(.*)$")
MIDLAYER_PREFIX = "midlayer."
LAYERS_PREFIX = "layers."
MODEL_PREFIX = "model."
VLLM_FUSED = {  # vLLM fused projections -> their parts, in row order
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
TARGET_EMBED_KEYS = ("model.embed_tokens.weight", "embed_tokens.weight")
TARGET_HEAD_KEY = "lm_head.weight"


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temp file in the same folder, then rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, obj: Any) -> None:
    """JSON (indent 2, sorted keys off) written atomically."""
    atomic_write_bytes(path, (json.dumps(obj, indent=2) + "\n").encode())


def hf_config_dict(cfg: DrafterConfig, dtype: torch.dtype) -> dict[str, Any]:
    """A flat SpecForge/SGLang-style config.json for ``cfg`` plus the ``slimspec`` section.

    Aux ids are written in the output-of-layer convention inside ``eagle_config`` (what
    SpecForge and SGLang read) and as boundaries at the top level (vLLM, speculators).
    """
    out: dict[str, Any] = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.resolved_head_dim,
        "num_hidden_layers": cfg.num_hidden_layers,
        "rms_norm_eps": cfg.rms_norm_eps,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "hidden_act": cfg.hidden_act,
        "attention_bias": cfg.attention_bias,
        "mlp_bias": cfg.mlp_bias,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": cfg.norm_before_fc,
        "fc_norm": cfg.fc_norm,
    }
    if cfg.target_hidden_size is not None:
        out["target_hidden_size"] = cfg.target_hidden_size
    if cfg.aux_layer_ids is not None:
        out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [b - 1 for b in cfg.aux_layer_ids]}
        out["eagle_aux_hidden_state_layer_ids"] = list(cfg.aux_layer_ids)
    if cfg.fc_bias:
        out["bias"] = True  # SGLang's name for the fc bias
    if cfg.norm_output_postnorm:
        out["norm_output"] = True  # engine meaning (post-norm recurrence); never SpecForge's (P7)
    if cfg.head_rank is not None:
        out["lm_head_rank"] = cfg.head_rank
        if cfg.hidden_size % cfg.head_rank == 0:  # TorchSpec PR #185: rank = hidden_size // divisor
            out["lm_head_rank_divisor"] = cfg.hidden_size // cfg.head_rank
    out[SLIMSPEC_SECTION] = {
        "version": __version__,
        "aux_layer_ids_convention": AUX_CONVENTION_BOUNDARY,
        "drafter_config": cfg.to_dict(),
    }
    return out


def save_drafter(
    drafter: Eagle3Drafter,
    out_dir: str | Path,
    *,
    dtype: torch.dtype | None = None,
    include_embeddings: bool = False,
    extra_config: dict[str, Any] | None = None,
) -> Path:
    """Write ``config.json`` + ``model.safetensors`` for a drafter, each file atomically.

    Args:
        drafter: the module.
        out_dir: destination folder (created).
        dtype: cast floating tensors to this dtype (``d2t``/``t2d`` keep int64/bool).
        include_embeddings: also store ``embed_tokens.weight`` (needed when dt != d).
        extra_config: merged into the ``slimspec`` section (e.g. training provenance).

    Returns:
        The folder path.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {}
    for key, value in drafter.state_dict().items():
        if key == EMBED_KEY and not include_embeddings:
            continue
        if key.startswith("rotary_emb."):
            continue
        t = value.detach().cpu()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        state[key] = t.contiguous()
    float_dtype = next(t.dtype for t in state.values() if t.is_floating_point())
    cfg = hf_config_dict(drafter.config, float_dtype)
    if extra_config:
        cfg[SLIMSPEC_SECTION].update(extra_config)
    fd, tmp = tempfile.mkstemp(dir=out, prefix=f".{WEIGHTS_NAME}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file(state, tmp, metadata={"format": "pt", "producer": f"slimspec {__version__}"})
        os.replace(tmp, out / WEIGHTS_NAME)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    atomic_write_json(out / CONFIG_NAME, cfg)
    return out


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


def load_native(path: str | Path, embed_from: Tensor | None = None) -> Eagle3Drafter:
    """Load a folder written by :func:`save_drafter` (strict: every key must match).

    Args:
        path: folder.
        embed_from: [V_t, d] table to borrow when the file has no ``embed_tokens.weight``.

    Returns:
        The drafter (parameters in the stored dtype).

    Raises:
        CheckpointError: missing config section, missing/extra/mis-shaped tensors.
    """
    p = Path(path)
    raw = read_config(p)
    if SLIMSPEC_SECTION not in raw:
        raise CheckpointError(f"{p / CONFIG_NAME}: no 'slimspec' section; not a SlimSpec-native drafter")
    cfg = DrafterConfig.from_dict(raw[SLIMSPEC_SECTION]["drafter_config"])
    state = load_file(str(p / WEIGHTS_NAME))
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


# ---- checkpoint folders (safetensors single / sharded, pytorch_model.bin) ----------------------


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
