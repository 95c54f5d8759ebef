"""The acceptance-cost model of SlimSpec (arXiv 2605.10453, section 3): pure arithmetic, no tensors.

Notation (the paper, arXiv 2605.10453; the style guide's section 1):

* ``rho_tau = tau_new / tau_full``: acceptance preservation of the new head;
* ``nu = T_head_new / T_head_full``: head latency factor;
* ``kappa = T_head_full / T_rest``: the full head's time over everything else in one speculation step
  (drafter body, verification, overhead).

Predicted end-to-end tokens/s ratio: ``rho_TPS = rho_tau (1 + kappa) / (1 + nu kappa)``. A cheaper head
pays off only if ``rho_tau > (1 + nu kappa) / (1 + kappa)`` (break-even) and no head change can beat
``1 + kappa`` (nu -> 0, rho_tau = 1).

To rank candidate heads from offline measurements, per-position acceptance ``alpha`` is turned into tau
with the i.i.d. chain model of Leviathan et al. 2023 (eq. 1): ``tau = (1 - alpha^(k+1)) / (1 - alpha)``
for ``k`` drafted tokens per round (accepted drafts + 1 bonus, so ``1 <= tau <= k + 1``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def _check_positive(name: str, value: float) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name}={value!r}: expected a finite number > 0")


def _check_non_negative(name: str, value: float) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
        raise ValueError(f"{name}={value!r}: expected a finite number >= 0")


def predicted_speedup(rho_tau: float, nu: float, kappa: float) -> float:
    """Predicted end-to-end tokens/s of the new head over the full head (SlimSpec eq. for rho_TPS).

    Args:
        rho_tau: tau_new / tau_full (> 0).
        nu: head latency new / full (>= 0).
        kappa: full-head latency / all other time in a speculation step (>= 0).

    Returns:
        ``rho_tau * (1 + kappa) / (1 + nu * kappa)``, dimensionless.

    Raises:
        ValueError: if rho_tau <= 0, or nu or kappa is negative or not finite.
    """
    _check_positive("rho_tau", rho_tau)
    _check_non_negative("nu", nu)
    _check_non_negative("kappa", kappa)
    return rho_tau * (1.0 + kappa) / (1.0 + nu * kappa)


def break_even_rho_tau(nu: float, kappa: float) -> float:
    """Smallest acceptance preservation at which the new head is not slower: ``(1 + nu kappa) / (1 + kappa)``.

    Args:
        nu: head latency new / full (>= 0).
        kappa: full-head latency / rest (>= 0).

    Returns:
        The break-even rho_tau (1.0 when kappa = 0 or nu = 1).

    Raises:
        ValueError: if nu or kappa is negative or not finite.
    """
    _check_non_negative("nu", nu)
    _check_non_negative("kappa", kappa)
    return (1.0 + nu * kappa) / (1.0 + kappa)


def speedup_ceiling(kappa: float) -> float:
    """Upper bound of rho_TPS over all head changes: ``1 + kappa`` (a free head, nu = 0, rho_tau = 1).

    Raises:
        ValueError: if kappa is negative or not finite.
    """
    _check_non_negative("kappa", kappa)
    return 1.0 + kappa


def kappa_from_times(head_ms: float, rest_ms: float) -> float:
    """``kappa = T_head_full / T_rest`` from measured milliseconds of one speculation step.

    Args:
        head_ms: time spent in the full head per speculation step, ms (>= 0).
        rest_ms: all other time of the step (drafter body, verification, overhead), ms (> 0).

    Raises:
        ValueError: if head_ms < 0 or rest_ms <= 0.
    """
    _check_non_negative("head_ms", head_ms)
    _check_positive("rest_ms", rest_ms)
    return head_ms / rest_ms


def expected_tau(alpha: float, num_draft_tokens: int) -> float:
    """Mean tokens per verification of a k-token chain with i.i.d. per-token acceptance alpha.

    Leviathan et al. 2023, eq. 1: ``(1 - alpha^(k+1)) / (1 - alpha)``; ``k + 1`` at alpha = 1.

    Args:
        alpha: per-position acceptance probability in [0, 1] (e.g. mean ``sum_v min(p_target, q_draft)``).
        num_draft_tokens: k >= 1.

    Returns:
        tau in [1, k + 1] (accepted drafts + 1 bonus).

    Raises:
        ValueError: if alpha is outside [0, 1] or k < 1.
    """
    if not (isinstance(alpha, int | float) and 0.0 <= alpha <= 1.0):
        raise ValueError(f"alpha={alpha!r}: expected a probability in [0, 1]")
    if not isinstance(num_draft_tokens, int) or num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens={num_draft_tokens!r}: expected an integer k >= 1")
    if alpha == 1.0:
        return float(num_draft_tokens + 1)
    return (1.0 - alpha ** (num_draft_tokens + 1)) / (1.0 - alpha)


@dataclass(frozen=True)
class RankCandidate:
    """One measured head: its rank (None = the full head), tau estimate and head latency.

    Attributes:
        rank: r, or None for the full (reference) head.
        tau: estimated tokens per verification with this head (e.g. :func:`expected_tau`), > 0.
        head_ms: measured latency of one head call, ms, > 0.
    """

    rank: int | None
    tau: float
    head_ms: float


@dataclass(frozen=True)
class RankPrediction:
    """Cost-model prediction for one candidate against the full head.

    Attributes:
        rank: r (None = the full head).
        rho_tau: tau / tau_full.
        nu: head_ms / full head_ms.
        predicted_speedup: rho_TPS.
        break_even_rho_tau: the rho_tau this head needs to break even.
    """

    rank: int | None
    rho_tau: float
    nu: float
    predicted_speedup: float
    break_even_rho_tau: float


@dataclass(frozen=True)
class RankRecommendation:
    """Every candidate's prediction and the chosen one (highest predicted rho_TPS).

    Attributes:
        kappa: the kappa used.
        predictions: one per candidate, in input order (the full head first).
        best: the prediction with the highest rho_TPS; ties go to the smaller rank (cheaper head).
        ceiling: 1 + kappa.
    """

    kappa: float
    predictions: tuple[RankPrediction, ...]
    best: RankPrediction
    ceiling: float


def recommend_rank(
    full: RankCandidate, candidates: Sequence[RankCandidate], kappa: float
) -> RankRecommendation:
    """Choose the head with the best predicted end-to-end speed (the full head is always a candidate).

    Args:
        full: the full head (rank None); its tau and head_ms are the references.
        candidates: low-rank (or trimmed) heads.
        kappa: full-head latency / rest of a speculation step (measured or given).

    Returns:
        A :class:`RankRecommendation`; ``best.rank is None`` means keep the full head.

    Raises:
        ValueError: if ``full.rank`` is not None, a tau or head_ms is not positive, or kappa < 0.
    """
    if full.rank is not None:
        raise ValueError(f"full.rank={full.rank}: the reference candidate must be the full head (rank None)")
    _check_non_negative("kappa", kappa)
    preds = []
    for c in (full, *candidates):
        _check_positive(f"tau (rank {c.rank})", c.tau)
        _check_positive(f"head_ms (rank {c.rank})", c.head_ms)
        rho_tau = c.tau / full.tau
        nu = c.head_ms / full.head_ms
        preds.append(
            RankPrediction(
                c.rank, rho_tau, nu, predicted_speedup(rho_tau, nu, kappa), break_even_rho_tau(nu, kappa)
            )
        )

    def key(p: RankPrediction) -> tuple[float, float]:
        # Highest speedup first; among exact ties prefer the smaller head (full head counts as infinite rank).
        return (-p.predicted_speedup, math.inf if p.rank is None else p.rank)

    best = min(preds, key=key)
    return RankRecommendation(
        kappa=kappa, predictions=tuple(preds), best=best, ceiling=speedup_ceiling(kappa)
    )
