"""Drafter files: the only code that reads or writes them and spells their keys (``names``).

Every published EAGLE-3 layout is mapped to canonical tensors (``dialects``), loaded strictly
(``load``) and written in SlimSpec's native layout (``save``).
"""

from slimspec_convert.checkpoint.folders import read_config
from slimspec_convert.checkpoint.load import (
    TargetTensors,
    inspect_drafter,
    load_drafter,
    load_drafter_with_target_embeddings,
)
from slimspec_convert.checkpoint.save import save_drafter
from slimspec_convert.checkpoint.weightfiles import CheckpointError

__all__ = [
    "CheckpointError",
    "TargetTensors",
    "inspect_drafter",
    "load_drafter",
    "load_drafter_with_target_embeddings",
    "read_config",
    "save_drafter",
]
