"""Truncated SVD of an lm_head into ``W_up @ W_down`` (pure math: tensors in, tensors out).

SlimSpec (arXiv 2605.10453, section 3) replaces ``z = W h`` by ``z = W_up (W_down h)``. This project
initialises the factors post hoc from a trained head by the Eckart-Young-optimal truncated SVD.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .config import (
    DEFAULT_EXACT_SVD_MAX_ELEMENTS,
    DEFAULT_RANDOMIZED_NITER,
    DEFAULT_RANDOMIZED_OVERSAMPLE,
)


@dataclass(frozen=True)
class Factorization:
    """Result of :func:`lowrank_factorize`.

    Attributes:
        W_up: [V_d, r], dtype of the input weight (or the requested dtype).
        W_down: [r, d], same dtype.
        singular_values: [min(V_d, d)] float64 when exact; the leading ``r + oversample`` when randomized.
        relative_error: ||W - W_up W_down||_F / ||W||_F, from the float32/64 factors before the cast.
        energy_retained: sum_{i<r} s_i^2 / ||W||_F^2.
        method: "exact" or "randomized".
    """

    W_up: Tensor
    W_down: Tensor
    singular_values: Tensor
    relative_error: float
    energy_retained: float
    method: str


def _check_weight(weight: Tensor) -> None:
    if weight.dim() != 2:
        raise ValueError(f"lm_head weight must be 2-D [V_d, d], got shape {tuple(weight.shape)}")
    if not torch.is_floating_point(weight):
        raise ValueError(f"lm_head weight must be floating point, got {weight.dtype}")
    if not torch.isfinite(weight).all():
        bad = int((~torch.isfinite(weight)).sum())
        raise ValueError(f"lm_head weight has {bad} NaN/inf entries; refusing to factorise")


def _check_rank(r: int, shape: tuple[int, int]) -> None:
    if not isinstance(r, int) or not 1 <= r <= min(shape):
        raise ValueError(
            f"rank r={r} is outside [1, min(V_d, d)] = [1, {min(shape)}] for an lm_head of shape {shape}"
        )


def spectrum(weight: Tensor) -> Tensor:
    """All singular values of ``weight``, computed in float64.

    Args:
        weight: [V_d, d] any float dtype.

    Returns:
        [min(V_d, d)] float64, descending.

    Raises:
        ValueError: non-2-D, non-float or non-finite weight.
    """
    _check_weight(weight)
    w = weight.to(torch.float64)
    # Gram matrix of the short side: min(V_d, d)^2 work after one V_d*d^2 product.
    gram = w.T @ w if w.shape[0] >= w.shape[1] else w @ w.T  # [d, d] or [V_d, V_d]
    eig = torch.linalg.eigvalsh(gram).clamp_min(0).flip(0)
    return eig.sqrt()


def choose_rank(
    singular_values: Tensor,
    hidden_size: int,
    *,
    rank: int | None = None,
    rank_fraction: float | None = None,
    energy: float | None = None,
    default_divisor: int = 8,
) -> int:
    """Resolve the kept rank r from one of three rules.

    Args:
        singular_values: [n] descending singular values of the head (any float dtype).
        hidden_size: d.
        rank: absolute r.
        rank_fraction: r = round(F * d).
        energy: smallest r with sum_{i<r} s_i^2 >= E * sum s_i^2.
        default_divisor: with no rule given, r = d // default_divisor (paper default d/8).

    Returns:
        r, an int in [1, n].

    Raises:
        ValueError: if more than one rule is given or the result is outside [1, n].
    """
    n = singular_values.numel()
    given = [x for x in (rank, rank_fraction, energy) if x is not None]
    if len(given) > 1:
        raise ValueError("give only one of rank, rank_fraction, energy")
    if rank is not None:
        r = rank
    elif rank_fraction is not None:
        r = max(1, round(rank_fraction * hidden_size))
    elif energy is not None:
        e = singular_values.to(torch.float64) ** 2
        cum = torch.cumsum(e, 0) / e.sum()
        r = int(torch.searchsorted(cum, torch.tensor(energy, dtype=torch.float64) - 1e-12).item()) + 1
    else:
        r = max(1, hidden_size // default_divisor)
    if not 1 <= r <= n:
        raise ValueError(f"rank r={r} is outside [1, min(V_d, d)] = [1, {n}]")
    return r


def lowrank_factorize(
    weight: Tensor,
    r: int,
    *,
    method: str = "auto",
    out_dtype: torch.dtype | None = None,
    generator: torch.Generator | None = None,
    exact_max_elements: int = DEFAULT_EXACT_SVD_MAX_ELEMENTS,
    oversample: int = DEFAULT_RANDOMIZED_OVERSAMPLE,
    niter: int = DEFAULT_RANDOMIZED_NITER,
) -> Factorization:
    """Best rank-r approximation of an lm_head weight, as two balanced factors.

    ``W_up = U_r S_r^(1/2)`` and ``W_down = S_r^(1/2) V_r^T`` (balanced split), so
    ``W_up @ W_down`` is the Frobenius-optimal rank-r approximation (Eckart-Young).

    The exact path takes the eigendecomposition of the d x d Gram matrix in float64 (exact to
    float64 precision for the kept directions, and far cheaper than a full SVD when V_d >> d).
    The randomized path (Halko et al. 2011, as ``torch.svd_lowrank``) runs in float32 with
    ``oversample`` extra directions and ``niter`` power iterations; its accuracy is checked by
    comparing the error it reaches with the Eckart-Young bound computed from the same spectrum
    estimate (see tests). The dense product ``W_up @ W_down`` is never formed.

    Args:
        weight: lm_head weight, shape [V_d, d] (nn.Linear layout), any float dtype.
        r: kept rank, 1 <= r <= min(V_d, d).
        method: "exact", "randomized" or "auto" (exact unless V_d * d > exact_max_elements * 4).
        out_dtype: dtype of the factors; defaults to weight.dtype.
        generator: randomness for the randomized path.
        exact_max_elements: threshold for "auto".
        oversample: extra directions for the randomized path.
        niter: power iterations for the randomized path.

    Returns:
        A :class:`Factorization` (W_up [V_d, r], W_down [r, d]).

    Raises:
        ValueError: weight not 2-D, not float, non-finite, or r outside [1, min(V_d, d)], or an
            unknown method.
    """
    _check_weight(weight)
    shape = (int(weight.shape[0]), int(weight.shape[1]))
    _check_rank(r, shape)
    out_dtype = out_dtype or weight.dtype
    if method == "auto":
        method = "exact" if weight.numel() <= exact_max_elements * 4 else "randomized"
    if method == "exact":
        W_up, W_down, s, total = _exact(weight, r)
    elif method == "randomized":
        W_up, W_down, s, total = _randomized(weight, r, oversample, niter, generator)
    else:
        raise ValueError(f"unknown SVD method {method!r}: expected exact, randomized or auto")
    kept = float((s[:r].to(torch.float64) ** 2).sum())
    energy_retained = kept / total
    rel_err = max(0.0, 1.0 - energy_retained) ** 0.5  # ||W - W_r||^2 = ||W||^2 - sum_{i<r} s_i^2
    return Factorization(
        W_up=W_up.to(out_dtype).contiguous(),
        W_down=W_down.to(out_dtype).contiguous(),
        singular_values=s,
        relative_error=rel_err,
        energy_retained=energy_retained,
        method=method,
    )


def _exact(weight: Tensor, r: int) -> tuple[Tensor, Tensor, Tensor, float]:
    V_d, d = weight.shape
    total = 0.0
    if V_d >= d:
        # Accumulate the [d, d] Gram matrix in float64 in row blocks: no float64 copy of W.
        gram = torch.zeros(d, d, dtype=torch.float64)
        for start in range(0, V_d, 8192):
            blk = weight[start : start + 8192].to(torch.float64)  # [<=8192, d]
            gram += blk.T @ blk
            total += float((blk * blk).sum())
        eigval, eigvec = torch.linalg.eigh(gram)  # ascending
        eigval = eigval.flip(0).clamp_min(0)
        eigvec = eigvec.flip(1)
        s = eigval.sqrt()  # [d]
        Vr = eigvec[:, :r]  # [d, r]
        sr = s[:r].clamp_min(torch.finfo(torch.float64).tiny)
        # U_r S_r = W V_r, so W_up = U_r S_r^(1/2) = W V_r S_r^(-1/2); computed in row blocks.
        W_up = torch.empty(V_d, r, dtype=torch.float32)
        scale = sr.rsqrt()
        for start in range(0, V_d, 8192):
            blk = weight[start : start + 8192].to(torch.float64)
            W_up[start : start + 8192] = ((blk @ Vr) * scale).to(torch.float32)  # [<=8192, r]
        W_down = (sr.sqrt()[:, None] * Vr.T).to(torch.float32)  # [r, d]
        return W_up, W_down, s, total
    f = _exact(weight.T, r)  # W^T = V S U^T: swap the roles of the factors
    return f[1].T, f[0].T, f[2], f[3]


def _randomized(
    weight: Tensor, r: int, oversample: int, niter: int, generator: torch.Generator | None
) -> tuple[Tensor, Tensor, Tensor, float]:
    w = weight.to(torch.float32)
    V_d, d = w.shape
    q = min(r + oversample, min(V_d, d))
    g = generator or torch.Generator().manual_seed(0)
    omega = torch.randn(d, q, generator=g, dtype=torch.float32)  # [d, q]
    Y = w @ omega  # [V_d, q]
    Q, _ = torch.linalg.qr(Y)
    for _ in range(niter):  # subspace (power) iteration with re-orthonormalisation
        Z, _ = torch.linalg.qr(w.T @ Q)  # [d, q]
        Q, _ = torch.linalg.qr(w @ Z)  # [V_d, q]
    B = Q.T @ w  # [q, d]
    Ub, s, Vh = torch.linalg.svd(B.to(torch.float64), full_matrices=False)
    sr = s[:r]
    W_up = (Q.to(torch.float64) @ (Ub[:, :r] * sr.sqrt())).to(torch.float32)  # [V_d, r]
    W_down = (sr.sqrt()[:, None] * Vh[:r]).to(torch.float32)  # [r, d]
    total = float((w.to(torch.float64) ** 2).sum()) if w.numel() < 2**27 else _blocked_sq_norm(w)
    return W_up, W_down, s, total


def _blocked_sq_norm(w: Tensor) -> float:
    return sum(float((w[i : i + 8192].to(torch.float64) ** 2).sum()) for i in range(0, w.shape[0], 8192))


def relative_error(weight: Tensor, W_up: Tensor, W_down: Tensor, block_rows: int = 8192) -> float:
    """||W - W_up W_down||_F / ||W||_F, computed in float64 row blocks (no dense product in memory).

    Args:
        weight: [V_d, d].
        W_up: [V_d, r].
        W_down: [r, d].
        block_rows: rows per block.

    Returns:
        The relative Frobenius error as a Python float.
    """
    num = 0.0
    den = 0.0
    Wd = W_down.to(torch.float64)
    for i in range(0, weight.shape[0], block_rows):
        w = weight[i : i + block_rows].to(torch.float64)
        approx = W_up[i : i + block_rows].to(torch.float64) @ Wd  # [<=block, d]
        num += float(((w - approx) ** 2).sum())
        den += float((w**2).sum())
    return (num / den) ** 0.5


def head_params(vocab_rows: int, hidden_size: int, rank: int | None) -> int:
    """Parameter count of a dense (rank None) or factorised lm_head: V d, or r (d + V)."""
    return vocab_rows * hidden_size if rank is None else rank * (hidden_size + vocab_rows)
