"""KL losses and acceptance metrics (pure math: tensors in, tensors out).

The training objective is the forward KL ``KL(ref || draft)`` over the **full** vocabulary
(SlimSpec section 3: the low-rank head keeps every token draftable). ``ref`` is what we train
toward: the target's next-token distribution, or the original full-head drafter when distilling
the head. With a trimmed draft vocabulary the draft puts zero mass outside its rows; we do *not*
renormalise the reference onto the draft subset (EAGLE/SpecForge do): the loss is the soft
cross-entropy of the unnormalised reference mass on the draft rows, whose minimiser is the
reference restricted to the subset and whose value differs from the subset KL by a constant.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from slimspec_convert.decoding.speculative import expected_acceptance_terms, top1_agreement  # noqa: F401  (the one home)


def kl_terms(ref_logits: Tensor, draft_logits: Tensor, draft_target_ids: Tensor | None = None) -> Tensor:
    """Per-position ``KL(ref || draft)`` in nats, float32.

    Args:
        ref_logits: [..., V_t] reference (target or original-head) logits, any float dtype.
        draft_logits: [..., V_d] drafter logits.
        draft_target_ids: [V_d] int64 target id of each draft row (``arange + d2t``), or None when
            V_d == V_t.

    Returns:
        [...] float32. For a trimmed vocabulary: ``sum_{i in D} p_i (log p_i - log q_i)``, the
        reference mass outside the draft vocabulary contributing no gradient (see module doc).
    """
    ref_logp = F.log_softmax(ref_logits.float(), dim=-1)
    if draft_target_ids is not None:
        ref_logp = ref_logp.index_select(-1, draft_target_ids)  # [..., V_d], not renormalised
    draft_logp = F.log_softmax(draft_logits.float(), dim=-1)
    ref_p = ref_logp.exp()
    return (ref_p * (ref_logp - draft_logp)).sum(-1)


def masked_mean(values: Tensor, mask: Tensor, denom: Tensor | float | None = None) -> Tensor:
    """Mean of ``values`` over positions where ``mask`` is true.

    Args:
        values: [...] float.
        mask: [...] bool or 0/1.
        denom: override the count (e.g. the global count across processes); defaults to mask.sum().

    Returns:
        Scalar float32; 0 when nothing is unmasked.
    """
    m = mask.to(values.dtype)
    total = (values * m).sum()
    n = m.sum() if denom is None else denom
    if isinstance(n, Tensor):
        return total / n.clamp_min(1)
    return total / max(float(n), 1.0)


def ttt_weights(num_steps: int, decay: float) -> list[float]:
    """Per-step loss weights ``decay**s`` (EAGLE/SpecForge ``ploss_decay`` 0.8, speculators 1.0)."""
    return [decay**s for s in range(num_steps)]
