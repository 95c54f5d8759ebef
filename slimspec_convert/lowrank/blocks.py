"""Row-block helpers shared by the exact and the randomized SVD.

Pure math; W is read in row blocks and never copied whole in float64."""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
from torch import Tensor

BLOCK_ROWS = 8192  # rows of W per block: 8192 x 4096 float32 = 128 MiB of scratch


class NonFiniteError(ValueError):
    """The weight holds NaN or inf entries (found during the first pass over it, at no extra cost)."""

    def __init__(self, count: int) -> None:
        super().__init__(f"lm_head weight has {count} NaN/inf entries; refusing to factorise")
        self.count = count


@contextmanager
def one_thread():
    """Run small LAPACK calls (eigh, Cholesky, triangular solves) on one thread.

    On a shared 2-core machine, MKL's float64 eigh of a [1088, 1088] matrix took 35 s with two
    OpenMP threads (they spin at barriers while another process holds a core) and 0.8 s with one.
    These calls are small next to the products with W, so one thread costs little when idle.
    """
    num = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(num)


def raise_if_nonfinite(total: float, weight: Tensor) -> None:
    """``total`` = ||W||_F^2 from a pass over W; not finite means NaN/inf (or float32 overflow)."""
    if math.isfinite(total):
        return
    bad = count_nonfinite(weight)
    if bad:
        raise NonFiniteError(bad)
    raise ValueError("lm_head weight entries overflow float32 when squared (|w| > 1e19); rescale the head")


def check_weight(weight: Tensor) -> None:
    """Raise ``ValueError`` unless ``weight`` is a 2-D floating-point lm_head weight [V_d, d]."""
    if weight.dim() != 2:
        raise ValueError(f"lm_head weight must be 2-D [V_d, d], got shape {tuple(weight.shape)}")
    if not torch.is_floating_point(weight):
        raise ValueError(f"lm_head weight must be floating point, got {weight.dtype}")


def check_rank(r: int, shape: tuple[int, int]) -> None:
    """Raise ``ValueError`` unless ``r`` is an integer in [1, min(V_d, d)] for a head of ``shape``."""
    if not isinstance(r, int) or isinstance(r, bool) or not 1 <= r <= min(shape):
        raise ValueError(
            f"rank r={r} is outside [1, min(V_d, d)] = [1, {min(shape)}] for an lm_head of shape {shape}"
        )


def row_blocks(weight: Tensor, block_rows: int = BLOCK_ROWS):
    """Yield (start, float32 block) over row blocks of ``weight``, reusing one scratch buffer."""
    buf = torch.empty(min(block_rows, weight.shape[0]), weight.shape[1], dtype=torch.float32)
    for start in range(0, weight.shape[0], block_rows):
        stop = min(start + block_rows, weight.shape[0])
        blk = buf[: stop - start]
        blk.copy_(weight[start:stop])  # [<=block_rows, d] float32; reads only these rows of a mmap
        yield start, blk


def count_nonfinite(weight: Tensor, block_rows: int = BLOCK_ROWS) -> int:
    """Number of NaN/inf entries, counted in row blocks (no full-size temporary).

    Each block is first summed (NaN and inf propagate into the sum); only a block whose sum is
    not finite is scanned element by element, so a clean head costs one cheap pass.

    Args:
        weight: [N, ...] any float dtype.
        block_rows: rows per block.

    Returns:
        The count (0 when all entries are finite).
    """
    bad = 0
    for i in range(0, weight.shape[0], block_rows):
        blk = weight[i : i + block_rows]
        acc = torch.float64 if blk.dtype == torch.float64 else torch.float32
        if not math.isfinite(float(blk.sum(dtype=acc))):
            bad += int((~torch.isfinite(blk)).sum())
    return bad


def same_rows(a: Tensor, b: Tensor, block_rows: int = BLOCK_ROWS) -> bool:
    """True when two [N, d] tables hold the same values, compared in row blocks (no full-size copy).

    Both are compared in the coarser of their two dtypes (larger ``eps``), so a bfloat16 copy of a
    float32 table counts as the same table; nothing else is tolerated.

    Args:
        a, b: [N, d] float tables (e.g. a drafter's lm_head weight and its embedding).
        block_rows: rows per block.

    Returns:
        False for different shapes or any differing entry.
    """
    if a.shape != b.shape:
        return False
    coarse = a.dtype if torch.finfo(a.dtype).eps >= torch.finfo(b.dtype).eps else b.dtype
    for i in range(0, a.shape[0], block_rows):
        if not torch.equal(a[i : i + block_rows].to(coarse), b[i : i + block_rows].to(coarse)):
            return False
    return True


def gram64(w: Tensor, row_weights: Tensor | None = None) -> tuple[Tensor, float]:
    """[d, d] float64 Gram matrix W^T D W and ||D^1/2 W||_F^2 (D = diag(row_weights), default I),
    accumulated over row blocks."""
    d = w.shape[1]
    gram = torch.zeros(d, d, dtype=torch.float64)
    total = 0.0
    for start in range(0, w.shape[0], BLOCK_ROWS):
        blk = w[start : start + BLOCK_ROWS].to(torch.float64)  # [<=block, d]
        wblk = blk if row_weights is None else blk * row_weights[start : start + BLOCK_ROWS, None]
        gram.addmm_(wblk.T, blk)
        total += float((wblk * blk).sum())
    raise_if_nonfinite(total, w)
    return gram, total


def split_scales(s: Tensor, rel_cutoff: float) -> tuple[Tensor, Tensor]:
    """(S^(-1/2), S^(1/2)) for the balanced split, with 0 for directions below the noise floor.

    A singular value below ``rel_cutoff * s_max`` is round-off of a rank-deficient head; its
    direction is dropped (zero column of W_up, zero row of W_down) rather than scaled by ~1/0.
    """
    keep = s > rel_cutoff * s.max().clamp_min(torch.finfo(torch.float64).tiny)
    safe = torch.where(keep, s, torch.ones_like(s))
    return torch.where(keep, safe.rsqrt(), 0.0), torch.where(keep, safe.sqrt(), 0.0)
