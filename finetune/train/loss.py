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

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from slimspec_convert.decoding.speculative import expected_acceptance_terms, top1_agreement  # noqa: F401  (the one home)
from slimspec_convert.model.vocab import draft_to_target_ids, trimmed_vocab_from_counts


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


HEAD_KL_CHUNK = 128
"""Rows per chunk of :meth:`ReferenceRows.head_kl`."""


@dataclass
class ReferenceRows:
    """Reference distributions at a set of positions, prepared once for several KL evaluations.

    Attributes:
        probs: [M, V_d] float32 reference probabilities (restricted to the draft rows, not
            renormalised, as :func:`kl_terms`).
        neg_entropy: [M] float32 ``sum_i p_i log p_i`` over those rows.
        mass: [M] float32 ``sum_i p_i`` over those rows (1, or less for a trimmed draft vocabulary).
        row_of: [B, T] int64 row of each position, -1 where none was prepared.
    """

    probs: Tensor
    neg_entropy: Tensor
    mass: Tensor
    row_of: Tensor

    def kl(self, b: Tensor, t: Tensor, draft_logits: Tensor) -> Tensor:
        """``KL(ref || draft)`` per position, as :func:`kl_terms`: [N] float32.

        Args:
            b, t: [N] int64 batch and time index of each reference row to use.
            draft_logits: [N, V_d] drafter logits (any float dtype; differentiable).

        Raises:
            IndexError: a position without a prepared row.
        """
        rows = self.row_of[b, t]
        if bool((rows < 0).any()):
            raise IndexError("KL asked at a position whose reference row was not prepared")
        return _RowKL.apply(
            draft_logits.float(), self.probs.index_select(0, rows), self.neg_entropy[rows], self.mass[rows]
        )

    def head_kl(self, b: Tensor, t: Tensor, x: Tensor, weight: Tensor, chunk: int | None = None) -> Tensor:
        """``KL(ref || softmax(x @ weight.T))`` per position for a **frozen** bias-free head, fused.

        Equal to ``self.kl(b, t, F.linear(x, weight))`` but computed ``chunk`` rows at a time: each
        chunk's logits, log-softmax and gradient ``(mass * softmax - p) @ weight`` are made while the
        chunk is in cache, and only the [N, d] input gradient is kept for the backward (no [N, V]
        logits or log-probabilities live across the TTT unroll). The chunked fused linear
        cross-entropy of Liger-Kernel / Apple's Cut Cross-Entropy, written for a soft target.

        Args:
            b, t: [N] int64 batch and time index of each reference row.
            x: [N, d] head input (differentiable; any float dtype, cast to ``weight.dtype``).
            weight: [V_d, d] frozen head weight; its dtype is the products' (bfloat16 on CPUs with
                bf16 units, float32 otherwise); log-softmax and KL run in float32.
            chunk: rows per chunk (default :data:`HEAD_KL_CHUNK`).

        Returns:
            [N] float32, differentiable with respect to ``x`` only.

        Raises:
            IndexError: a position without a prepared row.
        """
        rows = self.row_of[b, t]
        if bool((rows < 0).any()):
            raise IndexError("KL asked at a position whose reference row was not prepared")
        chunk = chunk or HEAD_KL_CHUNK
        return _HeadRowKL.apply(x, weight.detach(), self.probs, rows, self.neg_entropy, self.mass, chunk)


class _HeadRowKL(torch.autograd.Function):
    """:meth:`ReferenceRows.head_kl`: the loss and its input gradient in one chunked pass."""

    @staticmethod
    def forward(ctx, x, weight, probs, rows, neg_entropy, mass, chunk):
        xw = x.detach().to(weight.dtype)
        out = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
        gx = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        for s in range(0, x.shape[0], chunk):
            r = rows[s : s + chunk]
            logq = F.log_softmax(xw[s : s + chunk] @ weight.T, dim=-1, dtype=torch.float32)  # [c, V]
            out[s : s + chunk], g = _kl_and_logit_grad(
                logq, probs.index_select(0, r), neg_entropy[r], mass[r]
            )
            gx[s : s + chunk] = (g.to(weight.dtype) @ weight).float()
        ctx.save_for_backward(gx)
        ctx.x_dtype = x.dtype
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        (gx,) = ctx.saved_tensors
        return (gx * grad[:, None]).to(ctx.x_dtype), None, None, None, None, None, None


def _kl_and_logit_grad(logq: Tensor, p: Tensor, neg_entropy: Tensor, mass: Tensor) -> tuple[Tensor, Tensor]:
    """``sum_i p_i (log p_i - log q_i)`` [M] and its gradient in the logits ``mass * q - p`` [M, V],
    written into ``logq``'s storage (the cross term as a batched dot product)."""
    kl = neg_entropy - torch.bmm(p.unsqueeze(1), logq.unsqueeze(2)).reshape(-1)
    return kl, logq.exp_().mul_(mass[:, None]).sub_(p)


class _RowKL(torch.autograd.Function):
    """``sum_i p_i (log p_i - log softmax(z)_i)`` with its gradient ``mass * softmax(z) - p`` written
    out: one fused log-softmax forward, the gradient made in its place and scaled by the backward (no
    autograd graph over [N, V] temporaries)."""

    @staticmethod
    def forward(ctx, z: Tensor, p: Tensor, neg_entropy: Tensor, mass: Tensor) -> Tensor:
        kl, g = _kl_and_logit_grad(F.log_softmax(z, dim=-1), p, neg_entropy, mass)
        ctx.save_for_backward(g)
        return kl

    @staticmethod
    def backward(ctx, grad: Tensor):
        (g,) = ctx.saved_tensors
        return g * grad[:, None], None, None, None


def reference_rows(
    ref_logits: Tensor, where: Tensor, draft_target_ids: Tensor | None = None
) -> ReferenceRows:
    """Prepare :class:`ReferenceRows` from the reference logits at the True positions of ``where``.

    Args:
        ref_logits: [M, V_t] logits at ``where.nonzero()`` (row-major order), any float dtype.
        where: [B, T] bool.
        draft_target_ids: as :func:`kl_terms`.
    """
    ref_logp = F.log_softmax(ref_logits.float(), dim=-1)
    if draft_target_ids is not None:
        ref_logp = ref_logp.index_select(-1, draft_target_ids)
    return reference_rows_from_logp(ref_logp, where)


def reference_rows_from_logp(ref_logp: Tensor, where: Tensor) -> ReferenceRows:
    """:class:`ReferenceRows` from reference log-probabilities already normalised over the whole vocabulary.

    With the log-normaliser of every position known (``--feature-cache`` stores the target's), the
    reference on a subset of rows (``--loss-vocab``) is ``logits[:, ids] - logsumexp(logits)``: the
    head product runs over the subset only. Equal to :func:`reference_rows` of the full logits with
    ``draft_target_ids = ids``.

    Args:
        ref_logp: [M, V_d] log-probabilities at ``where.nonzero()`` (row-major order), float32.
        where: [B, T] bool.
    """
    probs = ref_logp.exp()
    row_of = torch.full(where.shape, -1, dtype=torch.int64, device=where.device)
    row_of[where] = torch.arange(probs.shape[0], device=where.device)
    return ReferenceRows(probs, (probs * ref_logp).sum(-1), probs.sum(-1), row_of)


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


def loss_vocabulary(
    counts_of: Callable[[int], Tensor], n: int, head_weight: Tensor | None, draft_ids: Tensor | None
) -> Tensor:
    """``--loss-vocab N``: the target ids the training KL runs over, [N] int64 ascending.

    The N ids most frequent among the training answers' supervised tokens, ties to the lower id and
    unseen ids in ascending order (:func:`trimmed_vocab_from_counts`, the trimming rule).

    Args:
        counts_of: vocabulary size V -> [V] supervised-token counts of the training data.
        n: N.
        head_weight: the frozen dense head's weight [V, d] (the fused head + KL), None for any other head.
        draft_ids: the drafter's draft-row target ids, None for a full-vocabulary drafter.

    Raises:
        ValueError: a trimmed draft vocabulary, a head that is not frozen and dense, or N > V.
    """
    if draft_ids is not None or head_weight is None:
        raise ValueError(
            f"loss_vocab={n}: needs a full-vocabulary drafter whose lm_head is a frozen dense layer "
            f"(train='body'); this drafter has "
            + ("a trimmed draft vocabulary (d2t)" if draft_ids is not None else "another head")
        )
    vocab_size = head_weight.shape[0]
    if n > vocab_size:
        raise ValueError(f"loss_vocab={n} exceeds the vocabulary ({vocab_size} tokens)")
    d2t, _ = trimmed_vocab_from_counts(counts_of(vocab_size), n)
    return draft_to_target_ids(d2t).to(head_weight.device)
