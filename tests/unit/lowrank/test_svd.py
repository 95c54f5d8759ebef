"""Truncated SVD of the lm_head: Eckart-Young optimality, balanced split, rank rules, randomized accuracy.

Reference values are computed independently with ``torch.linalg.svdvals`` in float64 and by
measuring ``||W - W_up W_down||_F`` directly; the rank-2 example is hand-computed (STYLE.md 7).
"""

from __future__ import annotations

import pytest
import torch

from slimspec_convert.lowrank.blocks import NonFiniteError
from slimspec_convert.lowrank.svd import (
    choose_rank,
    head_params,
    lowrank_factorize,
    rank_from_rule,
    relative_error,
    spectrum,
)


def _with_spectrum(rows: int, cols: int, s: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """float32 [rows, cols] matrix U diag(s) Q^T with random orthonormal U, Q (rows >= cols)."""
    g = torch.Generator().manual_seed(seed)
    U, _ = torch.linalg.qr(torch.randn(rows, len(s), generator=g, dtype=torch.float64))
    Q, _ = torch.linalg.qr(torch.randn(cols, len(s), generator=g, dtype=torch.float64))
    return (U * s.to(torch.float64) @ Q.T).float()


def _eckart_young(W: torch.Tensor, r: int) -> float:
    s = torch.linalg.svdvals(W.to(torch.float64))
    return float((s[r:] ** 2).sum().sqrt() / (s**2).sum().sqrt())


def _measured(W: torch.Tensor, W_up: torch.Tensor, W_down: torch.Tensor) -> float:
    W64 = W.to(torch.float64)
    return float(
        torch.linalg.norm(W64 - W_up.to(torch.float64) @ W_down.to(torch.float64)) / torch.linalg.norm(W64)
    )


def test_rank2_error_equals_dropped_singular_values():
    W = _with_spectrum(6, 5, torch.tensor([4.0, 3.0, 2.0, 1.0]))  # [6, 5], singular values 4, 3, 2, 1
    fac = lowrank_factorize(W, 2)
    rel_err = torch.linalg.norm(W - fac.W_up @ fac.W_down) / torch.linalg.norm(W)
    assert rel_err.item() == pytest.approx((5 / 30) ** 0.5, abs=1e-5)  # sqrt(2^2 + 1^2) / sqrt(30)
    assert fac.relative_error == pytest.approx((5 / 30) ** 0.5, abs=1e-6)
    assert fac.energy_retained == pytest.approx(25 / 30, abs=1e-6)


@pytest.mark.parametrize("shape", [(96, 40), (40, 96)])  # tall head and V_d < d
@pytest.mark.parametrize("r", [1, 7, 23])
def test_exact_error_is_eckart_young(shape, r):
    W = torch.randn(*shape, generator=torch.Generator().manual_seed(r))
    fac = lowrank_factorize(W, r, method="exact")
    bound = _eckart_young(W, r)
    assert _measured(W, fac.W_up, fac.W_down) == pytest.approx(bound, rel=1e-4)
    assert fac.relative_error == pytest.approx(bound, rel=1e-4)
    assert fac.W_up.shape == (shape[0], r) and fac.W_down.shape == (r, shape[1])


@pytest.mark.parametrize("method", ["exact", "randomized"])
def test_full_rank_rebuilds_W(method):
    W = torch.randn(70, 24, generator=torch.Generator().manual_seed(3))
    fac = lowrank_factorize(W, 24, method=method)
    assert torch.allclose(fac.W_up @ fac.W_down, W, atol=1e-5)
    assert fac.relative_error < 1e-3


def test_balanced_split_gives_both_factors_the_singular_values():
    s = torch.tensor([5.0, 3.0, 2.0, 0.5])
    W = _with_spectrum(30, 8, s)
    fac = lowrank_factorize(W, 3, method="exact")
    # W_up = U_r S^1/2, W_down = S^1/2 V_r^T  =>  W_up^T W_up = W_down W_down^T = diag(s_1..s_r)
    assert torch.allclose(fac.W_up.T @ fac.W_up, torch.diag(s[:3]), atol=1e-5)
    assert torch.allclose(fac.W_down @ fac.W_down.T, torch.diag(s[:3]), atol=1e-5)


@pytest.fixture(scope="module")
def spectra() -> dict:
    """Heads [4096, 128] with a Gaussian (Marchenko-Pastur, nearly flat) and i^-0.5, i^-1 spectra."""
    g = torch.Generator().manual_seed(11)
    heads = {"gaussian": torch.randn(4096, 128, generator=g)}
    for decay in (0.5, 1.0):
        heads[f"i^-{decay}"] = _with_spectrum(4096, 128, torch.arange(1, 129, dtype=torch.float64) ** -decay)
    return {name: (W, _eckart_young(W, 8)) for name, W in heads.items()}


@pytest.mark.parametrize("niter,tolerance", [(1, 0.02), (2, 0.005)])
def test_randomized_within_stated_tolerance_of_bound(spectra, niter, tolerance):
    """The tolerance documented in lowrank_factorize: <= 2 % (niter 1) and <= 0.5 % (niter 2) excess."""
    for name, (W, bound) in spectra.items():
        fac = lowrank_factorize(W, 8, method="randomized", niter=niter)  # q = 40: up to 3 blocks fit in d
        measured = _measured(W, fac.W_up, fac.W_down)
        assert fac.relative_error == pytest.approx(measured, rel=1e-4), name  # the factors' true error
        assert bound <= measured * (1 + 1e-6), name
        assert measured <= bound * (1 + tolerance), name


def test_randomized_niter0_is_measurably_worse(spectra):
    """Guard that the Krylov blocks matter: one block alone misses the bound by > 2 % on i^-0.5."""
    W, bound = spectra["i^-0.5"]
    fac = lowrank_factorize(W, 8, method="randomized", niter=0)
    assert _measured(W, fac.W_up, fac.W_down) > bound * 1.02


def test_randomized_wide_head_and_rank_deficient_head():
    g = torch.Generator().manual_seed(5)
    W = torch.randn(40, 300, generator=g)  # V_d < d
    fac = lowrank_factorize(W, 10, method="randomized", niter=2)
    assert _measured(W, fac.W_up, fac.W_down) == pytest.approx(_eckart_young(W, 10), rel=5e-3)
    L = torch.randn(50, 4, generator=g) @ torch.randn(4, 30, generator=g)  # rank 4, asked for 12
    for method in ("exact", "randomized"):
        fac = lowrank_factorize(L, 12, method=method)
        assert torch.isfinite(fac.W_up).all() and torch.isfinite(fac.W_down).all()
        assert _measured(L, fac.W_up, fac.W_down) < 1e-5


def test_bf16_head_factors_in_bf16_computed_in_float32():
    W32 = torch.randn(512, 64, generator=torch.Generator().manual_seed(2))
    W = W32.bfloat16()
    fac = lowrank_factorize(W, 16, method="exact")
    assert fac.W_up.dtype == torch.bfloat16 and fac.W_down.dtype == torch.bfloat16
    bound = _eckart_young(W.float(), 16)
    assert fac.relative_error == pytest.approx(bound, rel=1e-4)  # computed on float64 copies of bf16 rows
    assert _measured(W.float(), fac.W_up, fac.W_down) == pytest.approx(bound, rel=1e-2)  # bf16 rounding
    fac32 = lowrank_factorize(W, 16, method="exact", out_dtype=torch.float32)
    assert fac32.W_up.dtype == torch.float32


def test_relative_error_helper_matches_direct_norm():
    g = torch.Generator().manual_seed(4)
    W, A, B = torch.randn(20, 6, generator=g), torch.randn(20, 3, generator=g), torch.randn(3, 6, generator=g)
    assert relative_error(W, A, B, block_rows=7) == pytest.approx(_measured(W, A, B), rel=1e-12)


def test_spectrum_matches_svdvals():
    W = torch.randn(50, 12, generator=torch.Generator().manual_seed(6))
    assert torch.allclose(spectrum(W), torch.linalg.svdvals(W.double()), atol=1e-10)
    assert torch.allclose(spectrum(W.T), torch.linalg.svdvals(W.double()), atol=1e-10)


def test_choose_rank_rules_by_hand():
    s = torch.tensor([4.0, 3.0, 2.0, 1.0])  # energies 16, 9, 4, 1 of 30
    assert choose_rank(s, 64, energy=0.8) == 2  # 25/30 = 0.833 >= 0.8 > 16/30
    assert choose_rank(s, 64, energy=25 / 30) == 2
    assert choose_rank(s, 64, energy=0.84) == 3
    assert choose_rank(s, 64, energy=1.0) == 4
    assert rank_from_rule(64, 64) == 8  # default d/8
    assert rank_from_rule(64, 64, rank_fraction=0.25) == 16
    assert rank_from_rule(64, 64, rank=5) == 5
    assert head_params(32000, 4096, None) == 131_072_000
    assert head_params(32000, 4096, 512) == 512 * (4096 + 32000)


def test_bad_rank_and_bad_weight_raise():
    W = torch.randn(10, 6)
    with pytest.raises(ValueError, match=r"rank r=0 is outside \[1, min\(V_d, d\)\] = \[1, 6\]"):
        lowrank_factorize(W, 0)
    with pytest.raises(ValueError, match=r"rank r=7 is outside"):
        lowrank_factorize(W, 7)
    with pytest.raises(ValueError, match=r"rank r=9 is outside"):
        rank_from_rule(6, 64, rank=9)
    with pytest.raises(ValueError, match="only one of"):
        choose_rank(torch.ones(3), 8, rank=1, energy=0.5)
    bad = W.clone()
    bad[3, 2] = float("nan")
    bad[7, 0] = float("inf")
    for method in ("exact", "randomized"):
        with pytest.raises(NonFiniteError, match="2 NaN/inf entries"):
            lowrank_factorize(bad, 2, method=method)
    with pytest.raises(ValueError, match="must be 2-D"):
        lowrank_factorize(torch.randn(3, 4, 5), 2)
    with pytest.raises(ValueError, match="unknown SVD method"):
        lowrank_factorize(W, 2, method="qr")
