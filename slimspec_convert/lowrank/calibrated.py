"""Calibrated factorisation: the rank-r head with the smallest expected logit error E||(W - W_up W_down) h||^2
on real hidden states (truncated SVD of W C^1/2, data whitening as in SVD-LLM, arXiv 2403.07378)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from slimspec_convert.lowrank.blocks import (
    BLOCK_ROWS,
    check_rank,
    check_weight,
    gram64,
    one_thread,
    split_scales,
)
from slimspec_convert.lowrank.svd import Factorization

DEFAULT_CALIBRATION_DAMP = 0.01  # calibrated_factorize: lambda = damp * mean eigenvalue of E[h h^T]


# token_row_weights: share of the frequency term in the row weights (0 = every row alike). Measured on
# held-out *training* prompts (README at 8de2c04, "Converting"; SmolLM2 demo drafter, r = 72):
# chain-3 tau 1.186 / 1.228 / 1.248 / 1.251 for 0 / 0.5 / 0.9 / 1.0 (full head 1.288). 0.9 ties 1.0
# (3 tokens in 1,536) and keeps every row a floor weight of 0.1 when the counts come from few tokens.
DEFAULT_TOKEN_WEIGHT = 0.9


def token_row_weights(counts: Tensor, mix: float = DEFAULT_TOKEN_WEIGHT) -> Tensor:
    """Row weights ``w_v = mix * V p_v + (1 - mix)`` from token counts (mean 1, every row > 0).

    ``p_v = (n_v + 1/2) / sum(n + 1/2)`` is the smoothed frequency of token v as the next token at
    the calibration positions, so the weighted logit error of :func:`calibrated_factorize` spends
    the rank on the rows that speculation drafts and competes with, and never drops a row.

    Args:
        counts: [V_d] non-negative token counts (any dtype).
        mix: 0 <= mix <= 1; 0 gives uniform weights (the unweighted objective).

    Returns:
        [V_d] float64 weights, mean 1.

    Raises:
        ValueError: mix outside [0, 1], or negative / non-finite counts.
    """
    if not 0 <= mix <= 1:
        raise ValueError(f"token weight mix={mix}: expected 0 <= mix <= 1")
    c = counts.to(torch.float64)
    if c.dim() != 1 or not bool(torch.isfinite(c).all()) or bool((c < 0).any()):
        raise ValueError("token counts must be a 1-D tensor of finite, non-negative numbers")
    p = (c + 0.5) / float((c + 0.5).sum())
    return mix * c.numel() * p + (1.0 - mix)


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
    token_counts: Tensor | None = None  # [V_t] int64 next-token counts at the same positions


def calibrated_factorize(
    weight: Tensor,
    r: int,
    second_moment: Tensor,
    *,
    damp: float = DEFAULT_CALIBRATION_DAMP,
    row_weights: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> Factorization:
    """Rank-r factors minimising the expected (row-weighted) logit error on calibration hidden states.

    The plain truncated SVD minimises ``||W - W_up W_down||_F``, which weighs every direction of
    the hidden space alike; the drafter's normed hidden states are far from isotropic, so the
    head's logits can be poorly served by it. This solves instead

        min over rank-r A B of  E_h ||(W - A B) h||^2 = ||(W - A B) C^(1/2)||_F^2,
        C = E[h h^T] + lambda I,  lambda = damp * tr(E[h h^T]) / d,

    whose solution is the truncated SVD of ``W C^(1/2)`` mapped back (data-whitened SVD, as in
    SVD-LLM, Wang et al. 2024, arXiv 2403.07378, section 3.1): with ``W C^(1/2) ~ U_r S_r Q_r^T``,
    ``W_up = U_r S_r^(1/2)`` and ``W_down = S_r^(1/2) Q_r^T C^(-1/2)``. With ``row_weights``
    ``w`` (D = diag(w)) the objective is ``E_h sum_v w_v ((W - A B) h)_v^2 = ||D^(1/2) (W - A B)
    C^(1/2)||_F^2``, solved the same way from the SVD of ``D^(1/2) W C^(1/2)``: only the Gram
    matrix changes to ``W^T D W``, and ``W_up = W C^(1/2) Q_r S_r^(-1/2)`` keeps its formula
    (:func:`token_row_weights` weighs rows by how often the token is the next token). The minimum
    equals the Eckart-Young bound of ``W C^(1/2)`` (of ``D^(1/2) W C^(1/2)`` when weighted); the
    damping keeps directions that calibration never visits from being amplified by ``C^(-1/2)``.
    Computed from the [d, d] Gram matrix ``W^T D W`` (one float64 pass over W in row blocks, a
    second for ``W^T W`` when weighted) and two [d, d] eigendecompositions.

    Args:
        weight: lm_head weight [V_d, d], V_d >= d, any float dtype (may be memory-mapped).
        r: kept rank, 1 <= r <= d.
        second_moment: [d, d] ``E[h h^T]`` (symmetric positive semi-definite, any float dtype).
        damp: relative damping lambda / (tr C / d), > 0.
        row_weights: [V_d] positive row weights (None: every row alike).
        out_dtype: dtype of the factors; defaults to weight.dtype.

    Returns:
        A :class:`Factorization` with method "calibrated", ``relative_error`` the (larger than
        Eckart-Young) weight-space error of the returned factors, and ``logit_relative_error`` /
        ``svd_logit_relative_error`` under the damped moment (and the row weights) for these
        factors / the plain SVD.

    Raises:
        NonFiniteError: NaN/inf in the weight.
        ValueError: weight not 2-D float or wider than tall, r out of range, a moment that is not
            [d, d], not finite or has no positive trace, damp <= 0, or row weights that are not
            [V_d], finite and positive.
    """
    check_weight(weight)
    shape = (int(weight.shape[0]), int(weight.shape[1]))
    check_rank(r, shape)
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
    if row_weights is not None:
        row_weights = row_weights.to(torch.float64)
        if tuple(row_weights.shape) != (V_d,) or not bool(torch.isfinite(row_weights).all()):
            raise ValueError(f"row_weights: expected [{V_d}] finite weights, got {tuple(row_weights.shape)}")
        if not bool((row_weights > 0).all()):
            raise ValueError("row_weights: every weight must be > 0")
    gram, total = gram64(weight, row_weights)  # W^T D W [d, d]
    plain, plain_total = (gram, total) if row_weights is None else gram64(weight)  # W^T W
    with one_thread():
        lam, P = torch.linalg.eigh(C)
        lam = lam.clamp_min(damp * trace / d)  # >= lambda in exact arithmetic
        c_half = (P * lam.sqrt()) @ P.T  # C^(1/2)
        c_inv_half = (P * lam.rsqrt()) @ P.T  # C^(-1/2)
        M = c_half @ gram @ c_half  # (W C^(1/2))^T (W C^(1/2))
        eigval, eigvec = torch.linalg.eigh((M + M.T) / 2)
        _, G_vec = torch.linalg.eigh(plain)  # plain SVD directions, for the comparison figure
    s = eigval.flip(0).clamp_min(0).sqrt()  # singular values of W C^(1/2), descending
    Q = eigvec.flip(1)[:, :r]  # [d, r]
    up_scale, down_scale = split_scales(s[:r], 1e-12)
    Q = Q * (down_scale > 0)
    right = c_half @ Q * up_scale  # [d, r]: W_up = W C^(1/2) Q_r S_r^(-1/2) = U_r S_r^(1/2)
    W_down64 = (down_scale[:, None] * Q.T) @ c_inv_half  # [r, d]
    W_up = torch.empty(V_d, r, dtype=out_dtype)
    for start in range(0, V_d, BLOCK_ROWS):
        W_up[start : start + BLOCK_ROWS] = (weight[start : start + BLOCK_ROWS].to(torch.float64) @ right).to(
            out_dtype
        )
    # Errors from [d, d] algebra: E = W (I - X), ||D^(1/2) E C^(1/2)||^2 = tr((I - X)^T G (I - X) C)
    # with G = W^T D W; the weight error is unweighted, ||E||_F^2 = tr((I - X)^T W^T W (I - X)).
    eye = torch.eye(d, dtype=torch.float64)
    total_c = float((gram * C).sum())  # ||D^(1/2) W C^(1/2)||_F^2 = tr(G C)

    def errors(X: Tensor) -> tuple[float, float]:
        R = eye - X
        weight_err = float((R.T @ plain @ R).diagonal().sum()) / plain_total if plain_total > 0 else 0.0
        logit_err = float(((R.T @ gram @ R) * C).sum()) / total_c if total_c > 0 else 0.0
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
