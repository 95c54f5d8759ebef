"""The target's rows beside a drafter's head, for ``slimspec convert``: how alike they are, and the
full-vocabulary head of ``--full-vocab`` (a trimmed head's rows written into the target's)."""

from __future__ import annotations

import torch
from torch import Tensor

from slimspec_convert.checkpoint.canonical import ResolvedCheckpoint
from slimspec_convert.checkpoint.load import TargetTensors
from slimspec_convert.checkpoint.names import D2T_KEY
from slimspec_convert.checkpoint.weightfiles import CheckpointError
from slimspec_convert.lowrank.blocks import count_nonfinite
from slimspec_convert.model.vocab import draft_to_target_ids


def head_vs_target(W: Tensor, res: ResolvedCheckpoint, tgt: TargetTensors) -> dict[str, float]:
    """Mean cosine and norm ratio of drafter head rows [V_d, d] against the target rows of the same
    tokens (``{}`` when the target's head has another shape)."""
    H = tgt.head()
    if H.shape[1] != W.shape[1] or H.shape[0] != res.config.vocab_size:
        return {}
    ids = draft_to_target_ids(res.tensors[D2T_KEY].load()) if res.config.is_trimmed else None
    cos_sum, ratio_sum = 0.0, 0.0
    for start in range(0, W.shape[0], 8192):
        w = W[start : start + 8192].float()  # [<=8192, d]
        h = (H[ids[start : start + 8192]] if ids is not None else H[start : start + 8192]).float()
        cos_sum += float(torch.nn.functional.cosine_similarity(w, h, dim=1).sum())
        ratio_sum += float((w.norm(dim=1) / h.norm(dim=1).clamp_min(1e-12)).sum())
    return {"mean_cosine": cos_sum / W.shape[0], "mean_norm_ratio": ratio_sum / W.shape[0]}


def full_vocab_head(W: Tensor, res: ResolvedCheckpoint, tgt: TargetTensors) -> Tensor:
    """[V_t, d]: the target's head with the trimmed drafter's rows written at their target ids.

    Args:
        W: the drafter's [V_d, d] head rows (row i is target token i + d2t[i]).
        res: the resolved drafter checkpoint (config, ``d2t``).
        tgt: the target's tensors (its lm_head).

    Raises:
        ValueError: the target's head is not [vocab_size, d] of this drafter.
        CheckpointError: NaN/inf in the target's head.
    """
    cfg = res.config
    H = tgt.head()  # [V_t, dt]
    if H.shape[1] != cfg.hidden_size:
        raise ValueError(
            f"full_vocab: target {tgt.description} has hidden size {H.shape[1]} but the drafter has "
            f"d={cfg.hidden_size}; target head rows only fit a drafter of the same width"
        )
    if H.shape[0] != cfg.vocab_size:
        raise ValueError(
            f"full_vocab: target {tgt.description} has {H.shape[0]} head rows but the drafter's "
            f"vocab_size is {cfg.vocab_size}; is it the drafter's target?"
        )
    if bad := count_nonfinite(H):
        raise CheckpointError(f"full_vocab: target {tgt.description}: its lm_head has {bad} NaN/inf entries")
    full = torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=W.dtype)
    for start in range(0, full.shape[0], 8192):
        full[start : start + 8192] = H[start : start + 8192]
    full[draft_to_target_ids(res.tensors[D2T_KEY].load())] = W  # row i + d2t[i] <- drafter row i
    return full
