"""Calibrated factorisation: the rank-r head with the smallest expected logit error E||(W - W_up W_down) h||^2
on real hidden states (truncated SVD of W C^1/2, data whitening as in SVD-LLM, arXiv 2403.07378)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from slimspec_convert.lowrank.blocks import (
    BLOCK_ROWS,
    _check_rank,
    _check_weight,
    _gram64,
    _one_thread,
    _split_scales,
)
from slimspec_convert.lowrank.svd import Factorization

DEFAULT_CALIBRATION_DAMP = 0.01  # calibrated_factorize: lambda = damp * mean eigenvalue of E[h h^T]


@dataclass(frozen=True)
class HeadCalibration:
    """Second moment of the lm_head's input on calibration data, for :func:`calibrated_factorize`.

    Attributes:
        second_moment: [d, d] float64, ``E[h h^T]`` over the drafter's normed hidden states
            (the lm_head input) at supervised positions of every TTT step.
        rows: number of hidden states averaged.
        source: where they came from (files, sample count), for the report.
    """

    second_moment: Tensor
    rows: int
    source: str = ""


def calibrated_factorize(
    weight: Tensor,
    r: int,
    second_moment: Tensor,
    *,
    damp: float = DEFAULT_CALIBRATION_DAMP,
    out_dtype: torch.dtype | None = None,
) -> Factorization:
    """Rank-r factors minimising the expected logit error on calibration hidden states.

    The plain truncated SVD minimises ``||W - W_up W_down||_F``, which weighs every direction of
    the hidden space alike; the drafter's normed hidden states are far from isotropic, so the
    head's logits can be poorly served by it. This solves instead

        min over rank-r A B of  E_h ||(W - A B) h||^2 = ||(W - A B) C^(1/2)||_F^2,
        C = E[h h^T] + lambda I,  lambda = damp * tr(E[h h^T]) / d,

    whose solution is the truncated SVD of ``W C^(1/2)`` mapped back (data-whitened SVD, as in
    SVD-LLM, Wang et al. 2024, arXiv 2403.07378, section 3.1): with ``W C^(1/2) ~ U_r S_r Q_r^T``,
    ``W_up = U_r S_r^(1/2)`` and ``W_down = S_r^(1/2) Q_r^T C^(-1/2)``. The minimum equals the
    Eckart-Young bound of ``W C^(1/2)``; the damping keeps directions that calibration never
    visits from being amplified by ``C^(-1/2)``. Computed from the [d, d] Gram matrix ``W^T W``
    (one float64 pass over W in row blocks) and two [d, d] eigendecompositions.

    Args:
        weight: lm_head weight [V_d, d], V_d >= d, any float dtype (may be memory-mapped).
        r: kept rank, 1 <= r <= d.
        second_moment: [d, d] ``E[h h^T]`` (symmetric positive semi-definite, any float dtype).
        damp: relative damping lambda / (tr C / d), > 0.
        out_dtype: dtype of the factors; defaults to weight.dtype.

    Returns:
        A :class:`Factorization` with method "calibrated", ``relative_error`` the (larger than
        Eckart-Young) weight-space error of the returned factors, and ``logit_relative_error`` /
        ``svd_logit_relative_error`` under the damped moment for these factors / the plain SVD.

    Raises:
        NonFiniteError: NaN/inf in the weight.
        ValueError: weight not 2-D float or wider than tall, r out of range, a moment that is not
            [d, d], not finite or has no positive trace, or damp <= 0.
    """
    _check_weight(weight)
    shape = (int(weight.shape[0]), int(weight.shape[1]))
    _check_rank(r, shape)
    V_d, d = shape
    if V_d < d:
        raise ValueError(f"calibrated factorisation needs a head with V_d >= d, got shape {shape}")
    if tuple(second_moment.shape) != (d, d):
        raise ValueError(
            f"calibration second moment has shape {tuple(second_moment.shape)}, expected [{d}, {d}]"
        )
    if not damp > 0:
        raise ValueError(f"calibration damp={damp}: expected > 0")
    C = second_moment.to(torch.float64)
    C = (C + C.T) / 2
    trace = float(C.diagonal().sum())
    if not math.isfinite(trace) or trace <= 0 or not bool(torch.isfinite(C).all()):
        raise ValueError("calibration second moment is not finite or has no positive trace")
    C = C + (damp * trace / d) * torch.eye(d, dtype=torch.float64)
    out_dtype = out_dtype or weight.dtype
    gram, total = _gram64(weight)  # W^T W [d, d]
    with _one_thread():
        lam, P = torch.linalg.eigh(C)
        lam = lam.clamp_min(damp * trace / d)  # >= lambda in exact arithmetic
        c_half = (P * lam.sqrt()) @ P.T  # C^(1/2)
        c_inv_half = (P * lam.rsqrt()) @ P.T  # C^(-1/2)
        M = c_half @ gram @ c_half  # (W C^(1/2))^T (W C^(1/2))
        eigval, eigvec = torch.linalg.eigh((M + M.T) / 2)
        _, G_vec = torch.linalg.eigh(gram)  # plain SVD directions, for the comparison figure
    s = eigval.flip(0).clamp_min(0).sqrt()  # singular values of W C^(1/2), descending
    Q = eigvec.flip(1)[:, :r]  # [d, r]
    up_scale, down_scale = _split_scales(s[:r], 1e-12)
    Q = Q * (down_scale > 0)
    right = c_half @ Q * up_scale  # [d, r]: W_up = W C^(1/2) Q_r S_r^(-1/2) = U_r S_r^(1/2)
    W_down64 = (down_scale[:, None] * Q.T) @ c_inv_half  # [r, d]
    W_up = torch.empty(V_d, r, dtype=out_dtype)
    for start in range(0, V_d, BLOCK_ROWS):
        W_up[start : start + BLOCK_ROWS] = (weight[start : start + BLOCK_ROWS].to(torch.float64) @ right).to(
            out_dtype
        )
    # Errors from [d, d] algebra: E = W (I - X), ||E C^(1/2)||^2 = tr((I - X)^T G (I - X) C).
    eye = torch.eye(d, dtype=torch.float64)
    total_c = float((gram * C).sum())  # ||W C^(1/2)||_F^2 = tr(G C)

    def errors(X: Tensor) -> tuple[float, float]:
        R = eye - X
        RtGR = R.T @ gram @ R
        weight_err = float(RtGR.diagonal().sum()) / total if total > 0 else 0.0
        logit_err = float((RtGR * C).sum()) / total_c if total_c > 0 else 0.0
        return max(0.0, weight_err) ** 0.5, max(0.0, logit_err) ** 0.5

    X = (c_half @ Q) @ (Q.T @ c_inv_half)  # W_up W_down = W X
    weight_err, logit_err = errors(X)
    Vr = G_vec.flip(1)[:, :r]
    _, svd_logit_err = errors(Vr @ Vr.T)
    return Factorization(
        W_up=W_up,
        W_down=W_down64.to(out_dtype),
        singular_values=s,
        relative_error=weight_err,
        energy_retained=1.0 - logit_err**2,
        method="calibrated",
        logit_relative_error=logit_err,
        svd_logit_relative_error=svd_logit_err,
    )
