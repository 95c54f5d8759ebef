"""Cost model arithmetic on hand-computed cases (SlimSpec section 3; the paper's Llama-3.1-8B table)."""

from __future__ import annotations

import pytest

from slimspec_convert.lowrank.costmodel import (
    RankCandidate,
    break_even_rho_tau,
    expected_tau,
    kappa_from_times,
    predicted_speedup,
    recommend_rank,
    speedup_ceiling,
)


def test_paper_llama_rows():
    # r = d/8: 0.99 * 1.25 / (1 + 0.21 * 0.25) = 1.2375 / 1.0525 = 1.175772 (the table rounds rho_tau; with
    # rho_tau = 1.00 the same formula gives 1.25 / 1.0525 = 1.187648, the table's 1.19).
    assert predicted_speedup(0.99, 0.21, 0.25) == pytest.approx(1.2375 / 1.0525, abs=1e-12)
    assert predicted_speedup(0.99, 0.21, 0.25) == pytest.approx(1.175772, abs=1e-6)
    assert predicted_speedup(1.0, 0.21, 0.25) == pytest.approx(1.187648, abs=1e-6)
    # r = d/16: 0.98 * 1.25 / 1.035 = 1.183575 (table: 1.18).
    # VocabTrim 64k: 1.25 / 1.145 = 1.091703 (table: 1.09).
    assert predicted_speedup(0.98, 0.14, 0.25) == pytest.approx(1.183575, abs=1e-6)
    assert predicted_speedup(1.00, 0.58, 0.25) == pytest.approx(1.091703, abs=1e-6)


def test_break_even_and_ceiling():
    # (1 + 0.21 * 0.25) / 1.25 = 1.0525 / 1.25 = 0.842
    assert break_even_rho_tau(0.21, 0.25) == pytest.approx(0.842, abs=1e-12)
    assert predicted_speedup(0.842, 0.21, 0.25) == pytest.approx(1.0, abs=1e-12)
    assert speedup_ceiling(0.25) == 1.25
    assert predicted_speedup(1.0, 0.0, 0.25) == speedup_ceiling(0.25)
    assert break_even_rho_tau(1.0, 3.0) == 1.0  # an equally fast head needs equal acceptance
    assert predicted_speedup(0.9, 0.5, 0.0) == pytest.approx(0.9)  # kappa 0: only acceptance matters


def test_kappa_and_tau():
    assert kappa_from_times(2.0, 8.0) == 0.25
    # alpha 0.5, k 3: 1 + 0.5 + 0.25 + 0.125 = 1.875 = (1 - 0.5^4) / 0.5
    assert expected_tau(0.5, 3) == pytest.approx(1.875)
    assert expected_tau(1.0, 5) == 6.0
    assert expected_tau(0.0, 5) == 1.0


def test_invalid_inputs_raise():
    with pytest.raises(ValueError, match="rho_tau=0"):
        predicted_speedup(0, 0.2, 0.25)
    with pytest.raises(ValueError, match="kappa=-0.1"):
        speedup_ceiling(-0.1)
    with pytest.raises(ValueError, match="alpha=1.5"):
        expected_tau(1.5, 3)
    with pytest.raises(ValueError, match="rest_ms=0"):
        kappa_from_times(1.0, 0)
    with pytest.raises(ValueError, match="full.rank=8"):
        recommend_rank(RankCandidate(8, 2.0, 1.0), [], 0.25)


def test_recommendation_follows_the_model():
    # Injected tables: full head tau 4.0 at 10 ms; kappa 0.5.
    #   r=16: tau 3.0, 1 ms -> 0.75 * 1.5 / 1.05 = 1.071429
    #   r=32: tau 3.9, 2 ms -> 0.975 * 1.5 / 1.10 = 1.329545   <- best
    #   r=64: tau 4.0, 4 ms -> 1.0 * 1.5 / 1.20 = 1.25
    full = RankCandidate(None, 4.0, 10.0)
    cands = [RankCandidate(16, 3.0, 1.0), RankCandidate(32, 3.9, 2.0), RankCandidate(64, 4.0, 4.0)]
    rec = recommend_rank(full, cands, kappa=0.5)
    assert rec.best.rank == 32
    assert [round(p.predicted_speedup, 6) for p in rec.predictions] == [1.0, 1.071429, 1.329545, 1.25]
    assert rec.ceiling == 1.5
    # With a tiny kappa the head barely matters: losing acceptance never pays.
    rec = recommend_rank(full, cands, kappa=0.01)
    assert rec.best.rank == 64  # 1.0 * 1.01 / 1.004 = 1.005976 > full 1.0 > r=32 0.975 * 1.01 / 1.002
    # If every cheaper head loses too much acceptance, the full head is kept.
    rec = recommend_rank(full, [RankCandidate(16, 2.0, 1.0)], kappa=0.5)
    assert rec.best.rank is None
