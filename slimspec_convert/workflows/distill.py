"""``slimspec distill`` as a workflow: load the target, write its answers to the prompts of training files."""

from __future__ import annotations

from pathlib import Path

from slimspec_convert.data.distill import DistillConfig, DistillReport, distill
from slimspec_convert.data.self_prompts import SelfPromptConfig, SelfPromptReport, self_prompts
from slimspec_convert.targets.load import load_target


def distill_files(
    target: str | Path, data: list[str | Path], out: str | Path, cfg: DistillConfig, dtype: str = "float32"
) -> DistillReport:
    """Load the target and distil ``data`` into ``out`` (see :func:`slimspec_convert.data.distill.distill`).

    Raises:
        FileNotFoundError: a missing target or data file.
        DataError: bad data or a benchmark source.
    """
    model, tokenizer = load_target(target, dtype)
    return distill(model, tokenizer, list(data), out, cfg)


def self_prompt_file(
    target: str | Path, out: str | Path, cfg: SelfPromptConfig, dtype: str = "float32"
) -> SelfPromptReport:
    """Load the target and let it write user turns into ``out`` (see
    :func:`slimspec_convert.data.self_prompts.self_prompts`).

    Raises:
        FileNotFoundError: a missing target.
        DataError: see :func:`slimspec_convert.data.self_prompts.self_prompts`.
    """
    model, tokenizer = load_target(target, dtype)
    return self_prompts(model, tokenizer, out, cfg)
