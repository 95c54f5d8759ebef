"""Sweep the calibration's row weighting (``convert --calibration-token-weight M``) on one calibration pass.

The moment and the token counts come once from the default calibration (the target's own answers
to 64 built-in training prompts); each M gives a rank-r convert in OUT_PREFIX<M>. Measure them with
``examples/onpolicy_tau.py`` (held-out training prompts, never evaluation prompts).
Usage: python examples/calibration_weight_sweep.py SRC OUT_PREFIX M[,M...]
"""

import sys

import torch

from slimspec_convert.targets.fetch import get_smollm2
from slimspec_convert.workflows.calibrate import calibrate_from_files, default_calibration_files
from slimspec_convert.workflows.convert import ConvertConfig, convert

torch.set_num_threads(2)
src, prefix, mixes = sys.argv[1], sys.argv[2], [float(m) for m in sys.argv[3].split(",")]
target = get_smollm2()
calibration = calibrate_from_files(src, target, list(default_calibration_files()), device="cpu")
for mix in mixes:
    cfg = ConvertConfig(target=str(target), calibration_token_weight=mix, force=True)
    report = convert(src, f"{prefix}{mix}", cfg, calibration=calibration)
    print(f"M={mix}: {prefix}{mix}, logit error {report.calibration['logit_relative_error']:.4f}", flush=True)
