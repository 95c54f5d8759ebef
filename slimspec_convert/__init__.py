"""SlimSpec: low-rank LM heads for EAGLE-3 drafters (arXiv 2605.10453).

Convert a trained EAGLE-3 drafter's lm_head ``W [V_d, d]`` into ``W_up [V_d, r] @ W_down [r, d]``
by truncated SVD, recover acceptance with a short KL fine-tune, and run lossless speculative
decoding with it. The public API:

- :func:`load_drafter`: any published EAGLE-3 layout -> :class:`Eagle3Drafter` (strict, checked);
- :func:`convert` (alias :func:`convert_checkpoint`) with :class:`ConvertConfig`: the conversion;
- :class:`SpeculativeGenerator` with :class:`DraftConfig` / :class:`SamplingConfig`: lossless decoding;
- :func:`speculative_generate`: the same inside transformers,
  ``model.generate(**inputs, custom_generate=speculative_generate, drafter=drafter)``;
- :func:`lowrank_factorize`, :func:`calibrated_factorize`: the factorisation (tensors in, tensors out);
- :func:`predicted_speedup`: the cost model ``rho_TPS = rho_tau (1 + kappa) / (1 + nu kappa)``.

Subpackages, bottom to top: ``lowrank`` (math), ``targets``, ``model``, ``checkpoint``, ``decoding``,
``measure``, ``workflows``, ``cli``; ``finetune`` (a sibling package) sits below ``workflows``.
"""

from slimspec_convert.checkpoint.load import inspect_drafter, load_drafter
from slimspec_convert.decoding.config import DraftConfig, SamplingConfig
from slimspec_convert.decoding.generator import SpeculativeGenerator
from slimspec_convert.lowrank.calibrated import calibrated_factorize
from slimspec_convert.lowrank.costmodel import predicted_speedup
from slimspec_convert.lowrank.svd import lowrank_factorize
from slimspec_convert.model.drafter import Eagle3Drafter
from slimspec_convert.version import __version__
from slimspec_convert.workflows.convert import ConvertConfig, convert
from slimspec_convert.workflows.hf_generate import speculative_generate

convert_checkpoint = convert

__all__ = [
    "ConvertConfig",
    "DraftConfig",
    "Eagle3Drafter",
    "SamplingConfig",
    "SpeculativeGenerator",
    "__version__",
    "calibrated_factorize",
    "convert",
    "convert_checkpoint",
    "inspect_drafter",
    "load_drafter",
    "lowrank_factorize",
    "predicted_speedup",
    "speculative_generate",
]
