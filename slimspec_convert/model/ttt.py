"""Training-time test (TTT) unroll of an EAGLE-3 drafter (math layer: tensors in, tensors out).

EAGLE-3 (Li et al. 2025, section 3.2) trains the drafter on its own multi-step predictions: step
``s`` at position ``t`` takes the ground-truth token ``x_{t+1+s}`` and the drafter's own previous
output at ``t``, and predicts ``x_{t+2+s}``. Its attention sees the step-0 keys at positions
``<= t`` (real target features) and the keys of steps ``1..s`` at position ``t`` only: exactly what
the ``s``-th draft token sees at inference (the accepted prefix plus its own chain).

Deviation from SpecForge (documented): step ``s`` uses RoPE position ``t + s``, the position the
``s``-th draft token gets at inference in vLLM / SGLang and in our generator, instead of ``t``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from slimspec_convert.model.drafter import Eagle3Drafter
from slimspec_convert.model.kv_cache import DraftKVCache


def shift_left(x: Tensor, n: int, fill: int | float | bool = 0) -> Tensor:
    """``x[:, n:]`` padded on the right with ``fill`` to the original length ([B, T, ...])."""
    if n == 0:
        return x
    pad = x.new_full((x.shape[0], n, *x.shape[2:]), fill)
    return torch.cat([x[:, n:], pad], dim=1)


def ttt_attention_mask(seq_len: int, step: int, device: torch.device | None = None) -> Tensor:
    """Bool [1, 1, T, (step+1) T] mask: causal over step-0 keys, diagonal over steps 1..step."""
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    eye = torch.eye(seq_len, dtype=torch.bool, device=device)
    return torch.cat([causal] + [eye] * step, dim=1)[None, None]


@dataclass
class TTTStep:
    """One unrolled step.

    Attributes:
        step: s (0-based).
        hidden: [B, T, d] pre-norm drafter output at each position.
        ref_positions_shift: the target logits to compare with are at ``t + 1 + s``.
        valid: [B, T] bool: the predicted token ``t + 2 + s`` exists and is supervised.
    """

    step: int
    hidden: Tensor
    ref_positions_shift: int
    valid: Tensor


def ttt_unroll(
    drafter: Eagle3Drafter,
    input_ids: Tensor,
    aux_hidden: Tensor,
    loss_mask: Tensor,
    num_steps: int,
) -> Iterator[TTTStep]:
    """Yield the drafter's hidden output for each TTT step (compute the head/loss per step).

    Args:
        drafter: the drafter (train or eval mode).
        input_ids: [B, T] int64, right-padded (padding never precedes a real token).
        aux_hidden: [B, T, K*dt] target aux hidden states (ascending layer order).
        loss_mask: [B, T] bool, True where token ``p`` is supervised (assistant, not padding).
        num_steps: number of TTT steps K >= 1.

    Yields:
        :class:`TTTStep` for s = 0 .. K-1.
    """
    B, T = input_ids.shape
    cache = DraftKVCache()
    positions = torch.arange(T, device=input_ids.device)[None].expand(B, T)
    hidden = drafter.fuse(aux_hidden)  # [B, T, d]
    for s in range(num_steps):
        tokens = shift_left(input_ids, 1 + s, 0)  # x_{t+1+s}
        mask = None if s == 0 else ttt_attention_mask(T, s, input_ids.device)
        h = drafter(tokens, hidden, positions + s, cache=cache, attn_mask=mask)  # [B, T, d]
        valid = shift_left(loss_mask.bool(), 2 + s, False)  # token t+2+s supervised
        yield TTTStep(step=s, hidden=h, ref_positions_shift=1 + s, valid=valid)
        hidden = drafter.next_hidden(h)
