"""Offline acceptance of drafter heads on held-out data (sum_v min(p_v, q_v) and top-1 agreement).

The acceptance probability of speculative sampling (Leviathan et al. 2023, Theorem 3.5) comes from
:func:`slimspec_convert.decoding.speculative.expected_acceptance_terms`, the one implementation that
decoding, training and benchmarks share.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from slimspec_convert.decoding.speculative import expected_acceptance_terms, top1_agreement
from slimspec_convert.model.drafter import Eagle3Drafter
from slimspec_convert.model.vocab import draft_to_target_ids
from slimspec_convert.targets.forward import resolve_aux_layers, target_forward

_ROW_CHUNK = 256  # positions per softmax chunk (bounds memory at [256, V_t] float32)


@dataclass(frozen=True)
class AcceptanceStats:
    """Offline step-0 acceptance of one head.

    Attributes:
        expected_acceptance: mean over positions of ``sum_v min(p_target, q_draft)`` (temperature 1).
        top1_agreement: mean over positions of ``argmax q == argmax p`` (greedy acceptance).
        num_positions: positions averaged.
    """

    expected_acceptance: float
    top1_agreement: float
    num_positions: int


@torch.no_grad()
def expected_acceptance_by_head(
    drafter: Eagle3Drafter,
    target_model,
    batches: Sequence[Mapping[str, Tensor]],
    heads: Mapping[str, nn.Module],
) -> dict[str, AcceptanceStats]:
    """Step-0 acceptance of several heads on the same drafter body and data (one target pass per batch).

    Alignment (EAGLE-3): drafter position t takes the target's aux states at t and token x_{t+1};
    its logits predict x_{t+2}, so they are compared with the target's logits at t+1. A position
    counts when ``loss_mask`` marks x_{t+2} (an assistant token, not padding).

    Args:
        drafter: the drafter (its body, final norm and ``d2t`` are used; its own head is not).
        target_model: HF causal LM the drafter was trained for.
        batches: dicts with ``input_ids`` [B, T] int64, ``loss_mask`` [B, T] bool and optionally
            ``attention_mask`` [B, T] (right padding), on any device (moved to the drafter's).
        heads: name -> head mapping [..., d] to [..., V_d] draft-vocabulary logits.

    Returns:
        name -> :class:`AcceptanceStats`.

    Raises:
        ValueError: target and drafter vocabularies differ, or no position counts.
    """
    cfg = drafter.config
    aux_layers = resolve_aux_layers(drafter.config, target_model)
    dtype = next(p.dtype for p in drafter.parameters() if p.is_floating_point())
    sums = {n: torch.zeros(2, dtype=torch.float64) for n in heads}
    count = 0
    device = next(drafter.parameters()).device
    for batch in batches:
        ids, mask = batch["input_ids"].to(device), batch["loss_mask"].to(device).bool()
        attn = batch.get("attention_mask")
        B, T = ids.shape
        if T < 3:
            continue
        out = target_forward(
            target_model, ids, aux_layers, attention_mask=attn.to(device) if attn is not None else None
        )
        if out.logits.shape[-1] != cfg.vocab_size:
            raise ValueError(
                f"target logits have V_t={out.logits.shape[-1]}, drafter vocab_size={cfg.vocab_size}"
            )
        feat = drafter.fuse(out.aux_hidden[:, :-1].to(dtype))  # [B, T-1, d], g_t for t = 0..T-2
        pos = torch.arange(T - 1, device=device).expand(B, -1)  # [B, T-1]
        h = drafter(ids[:, 1:], feat, pos)  # [B, T-1, d], h_t predicts x_{t+2}
        valid = mask[:, 2:]  # [B, T-2], x_{t+2} supervised
        normed = drafter.norm(h[:, :-1])[valid]  # [N, d]
        ref = out.logits[:, 1:-1][valid]  # [N, V_t], target's distribution of x_{t+2}
        count += int(valid.sum())
        ids_map = draft_to_target_ids(drafter.d2t) if drafter.d2t is not None else None
        for start in range(0, ref.shape[0], _ROW_CHUNK):
            ref_chunk = ref[start : start + _ROW_CHUNK]  # [n, V_t]
            x = normed[start : start + _ROW_CHUNK]
            for name, head in heads.items():
                draft_logits = head(x).float()  # [n, V_d]
                sums[name][0] += float(expected_acceptance_terms(ref_chunk, draft_logits, ids_map).sum())
                sums[name][1] += float(top1_agreement(ref_chunk, draft_logits, ids_map).sum())
    if count == 0:
        raise ValueError("no supervised positions in the batches (need loss_mask on tokens at t >= 2)")
    return {n: AcceptanceStats(float(s[0]) / count, float(s[1]) / count, count) for n, s in sums.items()}


def expected_acceptance(
    drafter: Eagle3Drafter, target_model, batches: Sequence[Mapping[str, Tensor]]
) -> AcceptanceStats:
    """Step-0 offline acceptance of the drafter's own head (see :func:`expected_acceptance_by_head`)."""
    return expected_acceptance_by_head(drafter, target_model, batches, {"head": drafter.lm_head})["head"]
