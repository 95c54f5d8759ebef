"""Hugging Face cache operations for the verifier: empty caches, rollback to accepted slots, row selection."""

from __future__ import annotations

from torch import Tensor


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
