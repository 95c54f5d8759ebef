"""Lossless speculative decoding: the pure math of a round (``speculative``), the drafter runner, the
batch state, the generator (and the loop behind the transformers ``custom_generate`` callable), prompts
and results.
"""

from slimspec_convert.decoding.batch import DecodeHooks
from slimspec_convert.decoding.config import DraftConfig, GenerateConfig, SamplingConfig
from slimspec_convert.decoding.drafting import NonFiniteDecodeError
from slimspec_convert.decoding.generator import SpeculativeGenerator
from slimspec_convert.decoding.prompts import load_prompts
from slimspec_convert.decoding.results import GenerationResult, GenerationStats
from slimspec_convert.decoding.speculative import (
    expected_acceptance_terms,
    tau_from_committed,
    top1_agreement,
)

__all__ = [
    "DecodeHooks",
    "DraftConfig",
    "GenerateConfig",
    "GenerationResult",
    "GenerationStats",
    "NonFiniteDecodeError",
    "SamplingConfig",
    "SpeculativeGenerator",
    "expected_acceptance_terms",
    "load_prompts",
    "tau_from_committed",
    "top1_agreement",
]
