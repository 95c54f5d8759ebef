"""Target adapter: any Hugging Face causal LM -> logits plus the aux hidden states an EAGLE-3
drafter was trained on (eagle3-formats.md sections 5.1 and 6).

Aux states are read from ``output_hidden_states``: HF's ``hidden_states[b]`` is the residual
stream after ``b`` decoder blocks, i.e. *boundary* index ``b`` (``b = 0`` is the embedding output).
For ``b = L`` HF returns the post-final-norm state, while engines capture it before the norm; we
therefore refuse ``b = L`` rather than feed a different feature.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

logger = logging.getLogger(__name__)


@dataclass
class TargetOutput:
    """One target forward.

    Attributes:
        logits: [B, T, V_t] float32.
        aux_hidden: [B, T, K*dt], concatenated in ascending boundary order, model dtype.
        past_key_values: the HF cache after this call (None when not requested).
        final_hidden: [B, T, dt] the last layer's output after the final norm (the lm_head input),
            so logits at selected positions can be computed later with :func:`target_logits_at`.
    """

    logits: Tensor
    aux_hidden: Tensor
    past_key_values: object | None = None
    final_hidden: Tensor | None = None


def _dtype(name: str | torch.dtype | None) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    table = {
        None: torch.float32,
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if name not in table:
        raise ValueError(f"dtype {name!r}: expected one of float32, bfloat16, float16")
    return table[name]


def load_target(path: str | Path, dtype: str | torch.dtype | None = None):
    """Load a target model and its tokenizer from a local folder, a ``.gguf`` file or a hub id.

    Args:
        path: HF folder (config.json + weights + tokenizer), a GGUF file (loaded through
            transformers' ``gguf_file=``, dequantised), or a hub id where a network exists.
        dtype: float32 (default), bfloat16 or float16.

    Returns:
        (model in eval mode, tokenizer).

    Raises:
        FileNotFoundError: a local path that does not exist.
        ValueError: unknown dtype.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = _dtype(dtype)
    p = Path(path)
    if p.suffix == ".gguf":
        if not p.is_file():
            raise FileNotFoundError(f"{p}: GGUF file not found")
        tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
        model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch_dtype)
    else:
        if (str(path).startswith((".", "/")) or p.exists()) and not (p / "config.json").is_file():
            raise FileNotFoundError(f"{p}: not a model folder (no config.json)")
        tok = AutoTokenizer.from_pretrained(str(path))
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype)
    model.eval()
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model, tok


def num_target_layers(model) -> int:
    """L, the number of decoder layers of an HF causal LM."""
    return int(model.config.num_hidden_layers)


def target_lm_head(model) -> Tensor:
    """The target's output projection weight, [V_t, dt]."""
    return model.get_output_embeddings().weight


def target_embeddings(model) -> Tensor:
    """The target's input embedding table, [V_t, dt]."""
    return model.get_input_embeddings().weight


def check_aux_layers(boundaries: tuple[int, ...], num_layers: int) -> None:
    """Validate boundary ids against the target (0 <= b < L; see module docstring for b = L).

    Raises:
        ValueError: naming the bad id.
    """
    for b in boundaries:
        if not 0 <= b < num_layers:
            raise ValueError(
                f"aux layer boundary {b} is outside [0, {num_layers - 1}] for this {num_layers}-layer target"
            )


def target_forward(
    model,
    input_ids: Tensor,
    aux_layers: tuple[int, ...],
    *,
    attention_mask: Tensor | None = None,
    position_ids: Tensor | None = None,
    past_key_values=None,
    use_cache: bool = False,
    logits_to_keep: int | None = None,
) -> TargetOutput:
    """Run the target once and capture its aux hidden states.

    Args:
        model: HF causal LM.
        input_ids: [B, T] int64.
        aux_layers: boundary indices (ascending).
        attention_mask: [B, S] 0/1 padding mask, or a 4-D mask HF accepts.
        position_ids: [B, T] int64.
        past_key_values: HF cache to extend.
        use_cache: return the updated cache.
        logits_to_keep: compute logits only for the last N positions (memory).

    Returns:
        :class:`TargetOutput`.
    """
    cache_kw = _cache_kwarg(model)
    kwargs = {cache_kw: past_key_values}
    if logits_to_keep is not None:
        kwargs["logits_to_keep"] = logits_to_keep
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=use_cache,
        output_hidden_states=True,
        return_dict=True,
        **kwargs,
    )
    aux = torch.cat([out.hidden_states[b] for b in sorted(aux_layers)], dim=-1)  # [B, T, K*dt]
    return TargetOutput(
        logits=out.logits.float(),
        aux_hidden=aux,
        past_key_values=getattr(out, cache_kw),
        final_hidden=out.hidden_states[-1],
    )


_CACHE_KWARGS: dict[type, str] = {}


def _cache_kwarg(model) -> str:
    """Name of the KV-cache argument and output field: ``cache`` (transformers >= 5.x; the older
    ``past_key_values`` is deprecated there and goes in 5.40) or ``past_key_values`` (4.x)."""
    cls = type(model)
    if cls not in _CACHE_KWARGS:
        params = inspect.signature(cls.forward).parameters
        _CACHE_KWARGS[cls] = "cache" if "cache" in params else "past_key_values"
    return _CACHE_KWARGS[cls]


def target_logits_at(model, final_hidden: Tensor) -> Tensor:
    """Target logits for already gathered final hidden states.

    Args:
        model: HF causal LM.
        final_hidden: [..., dt] post-final-norm hidden states (``TargetOutput.final_hidden``).

    Returns:
        [..., V_t] float32 (applies any final logit soft-capping the model config declares).
    """
    logits = model.get_output_embeddings()(final_hidden).float()
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def new_target_cache():
    """An empty HF ``DynamicCache`` with plain (non-sliding) layers, so slots can be rolled back.

    Sliding-window layers would drop old slots on their own; the decoding loop instead applies
    windows through its attention masks (:func:`target_mask_windows`).
    """
    from transformers import DynamicCache

    return DynamicCache()


def target_mask_windows(model) -> dict[str, int | None]:
    """Attention window per layer type of an HF target: ``{layer_type: window or None}``.

    Llama-like models give ``{"full_attention": None}``; Mistral (no ``layer_types``, a
    ``sliding_window``) gives ``{"full_attention": W}``; hybrid models (Qwen2 with
    ``use_sliding_window``, ...) give one entry per type in ``config.layer_types``.
    """
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if not types:
        return {"full_attention": window}
    return {t: (window if t == "sliding_attention" else None) for t in dict.fromkeys(types)}


def cache_length(cache) -> int:
    """Slots held by an HF cache (all layers hold the same number here)."""
    return int(cache.get_seq_length())


def keep_cache_slots(cache, start: int, index: Tensor | None, length: int) -> None:
    """Roll an HF ``DynamicCache`` back after verification, keeping accepted slots only.

    Slots ``[0, start)`` stay; of the verified slots after ``start``, row b keeps
    ``start + index[b, j]`` as slot ``start + j``; everything after ``start + length`` is dropped.

    Args:
        cache: ``DynamicCache`` from :func:`new_target_cache`.
        start: S, slots before the verified block.
        index: [B, m] int64 offsets into the verified block (m = length), or None to keep the first
            ``length`` verified slots as they are (a chain: a crop, no copy).
        length: m, verified slots kept.
    """
    for layer in cache.layers:
        keys, values = layer.keys, layer.values
        if index is not None:
            B, H, _, hd = keys.shape
            idx = index[:, None, :, None].expand(B, H, index.shape[1], hd)  # [B, H, m, hd]
            keys[:, :, start : start + length] = keys[:, :, start:].gather(2, idx)
            values[:, :, start : start + length] = values[:, :, start:].gather(2, idx)
        layer.keys = keys[:, :, : start + length]
        layer.values = values[:, :, : start + length]


def select_cache_rows(cache, rows: Tensor) -> None:
    """Keep batch rows ``rows`` ([B'] int64) of an HF cache, in that order."""
    cache.batch_select_indices(rows)
