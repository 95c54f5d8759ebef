"""The verifier: load a Hugging Face target (folder, GGUF, hub id), forward it with aux hidden states,
operate its KV cache, fetch the SmolLM2 demo target.
"""

from slimspec_convert.targets.fetch import get_smollm2
from slimspec_convert.targets.forward import (
    TargetOutput,
    check_aux_layers,
    resolve_aux_layers,
    target_forward,
)
from slimspec_convert.targets.load import TargetError, load_target, load_tokenizer, num_target_layers

__all__ = [
    "TargetError",
    "TargetOutput",
    "check_aux_layers",
    "get_smollm2",
    "load_target",
    "load_tokenizer",
    "num_target_layers",
    "resolve_aux_layers",
    "target_forward",
]
