"""Writing SlimSpec-native drafter folders: ``config.json`` (flat EAGLE-3 Llama config plus a
``slimspec`` section holding the normalised config) and ``model.safetensors``, readable by SpecForge / SGLang
for dense heads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from slimspec_convert.atomic import atomic_path, atomic_write_json
from slimspec_convert.checkpoint.names import (
    CONFIG_NAME,
    DENSE_ARCHITECTURE,
    EMBED_KEY,
    HEAD_FROM_TARGET,
    LM_HEAD_KEY,
    LOWRANK_ARCHITECTURE,
    SLIMSPEC_SECTION,
    WEIGHTS_NAME,
)
from slimspec_convert.checkpoint.weightfiles import (  # noqa: F401
    CheckpointError,
    TensorRef,
    read_safetensors_header,
    write_safetensors,
)
from slimspec_convert.lowrank.blocks import count_nonfinite
from slimspec_convert.model.config import AUX_CONVENTION_BOUNDARY, DrafterConfig
from slimspec_convert.model.drafter import Eagle3Drafter
from slimspec_convert.version import __version__


def hf_config_dict(cfg: DrafterConfig, dtype: torch.dtype) -> dict[str, Any]:
    """A flat SpecForge/SGLang-style config.json for ``cfg`` plus the ``slimspec`` section.

    Aux ids are written in the output-of-layer convention inside ``eagle_config`` (what
    SpecForge and SGLang read) and as boundaries at the top level (vLLM, speculators; vLLM reads
    id ``b`` as the input of decoder layer ``b``, the residual stream after ``b`` blocks). A low-rank
    head names :data:`LOWRANK_ARCHITECTURE`, which only vLLM with the slimspec plugin resolves (stock
    engines refuse it instead of building a dense head the file cannot fill).
    """
    arch = DENSE_ARCHITECTURE if cfg.head_rank is None else LOWRANK_ARCHITECTURE
    out: dict[str, Any] = {
        "architectures": [arch],
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
    include_embeddings: bool | None = None,
    include_head: bool = True,
    extra_config: dict[str, Any] | None = None,
) -> Path:
    """Write ``config.json`` + ``model.safetensors`` for a drafter, each file atomically.

    Args:
        drafter: the module.
        out_dir: destination folder (created).
        dtype: cast floating tensors to this dtype (``d2t``/``t2d`` keep int64/bool).
        include_embeddings: store ``embed_tokens.weight``. None (default): whenever the drafter has
            its own table (``config.own_embeddings``, set by the loader when the source file shipped
            one) or its width d differs from the target's dt (the target's table cannot stand in);
            otherwise the reader borrows the target's, which every trainer freezes it to.
        include_head: store ``lm_head.weight``. False for a dense head that *is* the target's
            lm_head (a drafter trained with its head frozen at the target's, such as the SmolLM2
            demo drafter): the file then has no head and the loader borrows the target's, as
            engines do for head-less EAGLE-3 drafters (eagle3-formats.md P12). The caller vouches
            for the equality; a low-rank head is always stored.
        extra_config: merged into the ``slimspec`` section (e.g. training provenance).

    Returns:
        The folder path.

    Raises:
        ValueError: ``include_embeddings=False`` for a drafter whose table cannot be borrowed
            (d != dt): the folder could not be loaded back; NaN/inf in a tensor (after the cast to
            ``dtype``). Nothing is written then; ``include_head=False`` for a low-rank head or one
            whose width differs from the target's (d != dt).
    """
    out = Path(out_dir)
    include = _include_embeddings(drafter.config, include_embeddings, out)
    if not include_head and (
        drafter.config.head_rank is not None
        or drafter.config.resolved_target_hidden_size != drafter.config.hidden_size
    ):
        raise ValueError(
            f"{out}: include_head=False needs a dense head as wide as the target's (head_rank="
            f"{drafter.config.head_rank}, hidden_size={drafter.config.hidden_size}, target_hidden_size="
            f"{drafter.config.resolved_target_hidden_size}): the target's lm_head could not stand in"
        )
    state = {}
    for key, value in drafter.state_dict().items():
        skip = (key == EMBED_KEY and not include) or (key == LM_HEAD_KEY and not include_head)
        if skip or key.startswith("rotary_emb."):
            continue
        t = value.detach().cpu()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        if t.is_floating_point() and t.dim() and (bad := count_nonfinite(t)):
            raise ValueError(
                f"{out / WEIGHTS_NAME}: '{key}' has {bad} NaN/inf entries ({t.dtype}); refusing to write it"
            )
        state[key] = t.contiguous()
    out.mkdir(parents=True, exist_ok=True)
    float_dtype = next(t.dtype for t in state.values() if t.is_floating_point())
    cfg = hf_config_dict(drafter.config.replace(own_embeddings=include), float_dtype)
    if not include_head:
        cfg[SLIMSPEC_SECTION][HEAD_FROM_TARGET] = True
    if extra_config:
        cfg[SLIMSPEC_SECTION].update(extra_config)
    with atomic_path(out / WEIGHTS_NAME) as tmp:
        save_file(state, str(tmp), metadata={"format": "pt", "producer": f"slimspec {__version__}"})
    atomic_write_json(out / CONFIG_NAME, cfg)
    return out


def _include_embeddings(cfg: DrafterConfig, asked: bool | None, out: Path) -> bool:
    """Whether ``embed_tokens`` must be written (see :func:`save_drafter`)."""
    cannot_borrow = cfg.resolved_target_hidden_size != cfg.hidden_size
    if asked is None:
        return cfg.own_embeddings or cannot_borrow
    if not asked and cannot_borrow:
        raise ValueError(
            f"{out}: include_embeddings=False, but the drafter's '{EMBED_KEY}' is [vocab_size, "
            f"hidden_size={cfg.hidden_size}] and its target's table is [vocab_size, "
            f"target_hidden_size={cfg.resolved_target_hidden_size}]: the folder could not be loaded back"
        )
    return asked
