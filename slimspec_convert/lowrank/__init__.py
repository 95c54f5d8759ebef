"""The paper's math: truncated and calibrated SVD of an lm_head, randomized block Krylov, the cost model.

Tensors and floats in, tensors and floats out; no files, no devices chosen, no printing.
"""

from slimspec_convert.lowrank.blocks import NonFiniteError, count_nonfinite
from slimspec_convert.lowrank.calibrated import HeadCalibration, calibrated_factorize
from slimspec_convert.lowrank.costmodel import (
    break_even_rho_tau,
    expected_tau,
    kappa_from_times,
    predicted_speedup,
    recommend_rank,
    speedup_ceiling,
)
from slimspec_convert.lowrank.svd import (
    Factorization,
    choose_rank,
    head_params,
    lowrank_factorize,
    rank_from_rule,
    relative_error,
    spectrum,
)

__all__ = [
    "Factorization",
    "HeadCalibration",
    "NonFiniteError",
    "break_even_rho_tau",
    "calibrated_factorize",
    "choose_rank",
    "count_nonfinite",
    "expected_tau",
    "head_params",
    "kappa_from_times",
    "lowrank_factorize",
    "predicted_speedup",
    "rank_from_rule",
    "recommend_rank",
    "relative_error",
    "spectrum",
    "speedup_ceiling",
]
