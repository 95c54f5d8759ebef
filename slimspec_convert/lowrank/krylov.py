"""Randomized block Krylov SVD of a tall matrix read in row blocks (pure math; used by factorize).

Musco & Musco (NeurIPS 2015) block Krylov iteration on the row space, started from a CountSketch
(Clarkson & Woodruff, STOC 2013), with CholeskyQR2 orthonormalisation (Fukaya et al. 2014) and a
Rayleigh-Ritz step assembled from products already computed. See
:func:`slimspec_convert.lowrank.svd.lowrank_factorize` for the accuracy check.
"""

from __future__ import annotations

import torch
from torch import Tensor

from slimspec_convert.lowrank.blocks import (
    BLOCK_ROWS,
    _blocks,
    _one_thread,
    _raise_if_nonfinite,
    _split_scales,
)


def _orthonormalize(Z: Tensor) -> Tensor:
    """Orthonormal basis of the columns of Z [m, q] (float64 CholeskyQR2; Householder QR if rank-deficient).

    CholeskyQR2 (Fukaya et al. 2014) runs on matrix products, several times faster than LAPACK's
    Householder QR on two cores, and is orthonormal to float64 round-off after the second pass.
    """
    Q = Z.to(torch.float64)
    with _one_thread():
        for _ in range(2):
            R, info = torch.linalg.cholesky_ex(Q.T @ Q, upper=True)
            if int(info) != 0:  # numerically rank-deficient block (tiny heads): fall back to Householder
                return torch.linalg.qr(Q)[0]
            Q = torch.linalg.solve_triangular(R, Q, upper=True, left=False)  # Z R^(-1)
    return Q


def _orth_against(Z: Tensor, basis: list[Tensor]) -> Tensor:
    """Float32 orthonormal columns spanning Z with the span of ``basis`` removed (two passes)."""
    Z = Z.to(torch.float64)
    for _ in range(2):
        for B in basis:
            B = B.to(torch.float64)
            Z = Z - B @ (B.T @ Z)
        Z = _orthonormalize(Z)
    return Z.to(torch.float32)


def _count_sketch(w: Tensor, q: int, g: torch.Generator) -> tuple[Tensor, float]:
    """S^T W [q, m] for a sparse sign matrix S (one +-1 per row), and ||W||_F^2, in one pass.

    Rows are dealt to buckets in turn within each block (bucket = row mod q, then a random
    permutation of the buckets per block) with independent random signs: a CountSketch whose
    hash is a per-block random shift of a fixed pattern, so it costs one vectorised sum per block.
    """
    n, m = w.shape
    Zt = torch.zeros(q, m, dtype=torch.float32)
    total = 0.0
    for _start, blk in _blocks(w):
        rows = blk.shape[0]
        sign = torch.randint(0, 2, (rows,), generator=g).to(torch.float32).mul_(2).sub_(1)
        full = (rows // q) * q
        part = torch.einsum("kq,kqm->qm", sign[:full].view(-1, q), blk[:full].view(-1, q, m))  # [q, m]
        part[: rows - full].addcmul_(blk[full:], sign[full:, None])
        Zt.index_add_(0, torch.randperm(q, generator=g), part)
        total += float(torch.linalg.vector_norm(blk, dim=1).to(torch.float64).pow(2).sum())
    _raise_if_nonfinite(total, w)
    return Zt, total


def _krylov_passes(w: Tensor, basis: list[Tensor], depth: int) -> tuple[list[Tensor], list[Tensor], Tensor]:
    """Extend ``basis`` to ``depth`` blocks, one pass over W per block.

    Returns:
        (Y_k = W Q_k [n, q] for every block, Z_k = W^T W Q_k [m, q] for all but the last, Y_D^T Y_D).
    """
    n, m = w.shape
    q = basis[0].shape[1]
    Ys: list[Tensor] = []  # [n, q] float32 each
    Zs: list[Tensor] = []  # [m, q] float32 each
    C_last = torch.zeros(q, q, dtype=torch.float64)
    for k in range(depth):
        last = k == depth - 1
        Y = torch.empty(n, q, dtype=torch.float32)
        Z = None if last else torch.zeros(m, q, dtype=torch.float32)
        for start, blk in _blocks(w):
            y = torch.mm(blk, basis[k], out=Y[start : start + blk.shape[0]])  # [rows, q]
            if last:
                C_last += (y.T @ y).to(torch.float64)
            else:
                Z.addmm_(blk.T, y)  # accumulates W^T W Q_k in the same pass over W
        Ys.append(Y)
        if not last:
            Zs.append(Z)
            basis.append(_orth_against(Z, basis))
    return Ys, Zs, C_last


def _ritz_matrix(basis: list[Tensor], Zs: list[Tensor], C_last: Tensor) -> Tensor:
    """C = K^T W^T W K for K = [Q_1 .. Q_D], from quantities already computed (no pass over W)."""
    depth, q = len(basis), basis[0].shape[1]
    C = torch.zeros(depth * q, depth * q, dtype=torch.float64)
    for i in range(depth):
        for j in range(i, depth):
            if i == depth - 1:
                block = C_last
            else:
                block = Zs[i].T.to(torch.float64) @ basis[j].to(torch.float64)  # (G Q_i)^T Q_j = Y_i^T Y_j
            C[i * q : (i + 1) * q, j * q : (j + 1) * q] = block
            C[j * q : (j + 1) * q, i * q : (i + 1) * q] = block.T
    return (C + C.T) / 2


def randomized_factors(
    w: Tensor, r: int, oversample: int, niter: int, generator: torch.Generator | None, out_dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor, float, float]:
    """Tall w [n, m] (n >= m): randomized block Krylov factors (see ``factorize.lowrank_factorize``).

    Returns:
        (W_up [n, r], W_down [r, m] in out_dtype, Ritz values float64, kept energy, ||W||_F^2).
    """
    n, m = w.shape
    q = min(r + oversample, m)
    depth = max(1, min(niter + 1, m // q))  # the Krylov basis has depth * q <= m columns
    Zt, total = _count_sketch(w, q, generator or torch.Generator().manual_seed(0))
    basis = [_orth_against(Zt.T, [])]  # Q_1 [m, q]
    Ys, Zs, C_last = _krylov_passes(w, basis, depth)
    with _one_thread():
        eigval, eigvec = torch.linalg.eigh(_ritz_matrix(basis, Zs, C_last))
    eigval = eigval.flip(0).clamp_min(0)
    Ur = eigvec.flip(1)[:, :r]  # [depth*q, r]
    s = eigval.sqrt()  # Ritz values
    up_scale, down_scale = _split_scales(s[:r], 1e-6)  # float32 products: noise floor ~1e-7 s_max
    kept = float((eigval[:r] * (down_scale > 0)).sum())
    K = torch.cat(basis, dim=1).to(torch.float64)  # [m, depth*q], orthonormal
    W_down = (down_scale[:, None] * (K @ Ur).T).to(out_dtype)  # S^(1/2) X^T, [r, m]
    M = (Ur * up_scale).to(torch.float32)  # [depth*q, r]
    W_up = torch.empty(n, r, dtype=out_dtype)
    for start in range(0, n, BLOCK_ROWS):
        stop = min(start + BLOCK_ROWS, n)
        WK = torch.cat([Y[start:stop] for Y in Ys], dim=1)  # [rows, depth*q] = rows of W K
        W_up[start:stop] = (WK @ M).to(out_dtype)  # W X S^(-1/2)
    return W_up, W_down, s, kept, total
