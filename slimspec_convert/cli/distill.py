"""CLI command ``slimspec distill``: the target's own answers to training prompts, as conversations."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Annotated

import typer

from slimspec_convert.cli.app import apply_threads, command, config_fields
from slimspec_convert.data.distill import DistillConfig
from slimspec_convert.workflows.distill import distill_files

_D = DistillConfig()


@command()
def distill(
    target: Annotated[str, typer.Option(help="target model folder, .gguf file or hub id")],
    data: Annotated[list[Path], typer.Option(help="training file(s): their first user turns are answered")],
    out: Annotated[Path, typer.Option(help="JSONL file to write (extended with what is missing)")],
    batch_size: Annotated[int, typer.Option(help="prompts per generate call (left-padded)")] = _D.batch_size,
    max_new_tokens: Annotated[int, typer.Option(help="answer length cap")] = _D.max_new_tokens,
    max_prompt_tokens: Annotated[
        int, typer.Option(help="prompts longer than this (rendered, in tokens) are skipped and counted")
    ] = _D.max_prompt_tokens,
    temperature: Annotated[float, typer.Option(help="0 = greedy; > 0 = sampled data")] = _D.temperature,
    top_p: Annotated[float, typer.Option(help="nucleus mass for sampled data")] = _D.top_p,
    seed: Annotated[int, typer.Option(help="sampling seed")] = _D.seed,
    limit: Annotated[int | None, typer.Option(help="answer at most N prompts (file order)")] = _D.limit,
    system_prompt: Annotated[
        str | None, typer.Option(help="system message (default: the source's, else the template's)")
    ] = _D.system_prompt,
    allow_eval_data: Annotated[
        bool, typer.Option("--allow-eval-data", help="accept benchmark prompts as a source")
    ] = _D.allow_eval_data,
    shuffle: Annotated[
        bool,
        typer.Option("--shuffle", help="answer in a seeded random order (a partial run covers every file)"),
    ] = _D.shuffle,
    exclude: Annotated[
        list[Path] | None, typer.Option(help="file(s) whose prompts are left out (held-out prompts)")
    ] = None,
    dtype: Annotated[
        str, typer.Option(help="target dtype: float32 or bfloat16 (AMX CPUs: ~1.7x faster)")
    ] = "float32",
    threads: Annotated[int | None, typer.Option(help="torch CPU threads (default: torch's)")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
) -> None:
    """Write the target's own answers to the prompts of --data (self-distilled, on-policy training data)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    apply_threads(threads)
    cfg = DistillConfig(**config_fields(DistillConfig, locals(), exclude=tuple(map(str, exclude or ()))))
    report = distill_files(target, data, out, cfg, dtype)
    typer.echo(json.dumps(report.to_dict(), indent=2) if json_out else report.summary())
