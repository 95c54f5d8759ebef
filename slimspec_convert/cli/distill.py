"""CLI commands ``slimspec distill`` (the target's answers to training prompts) and ``self-prompts``."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Annotated

import typer

from slimspec_convert.cli.app import CHAT_HELP, command, config_fields
from slimspec_convert.data.distill import DistillConfig
from slimspec_convert.data.self_prompts import SelfPromptConfig
from slimspec_convert.workflows.distill import distill_files, self_prompt_file

_D = DistillConfig()
_Target = Annotated[str, typer.Option(help="target model folder, .gguf file or hub id")]
_Dtype = Annotated[str, typer.Option(help="target dtype: float32 or bfloat16 (AMX CPUs: ~1.7x faster)")]
_Json = Annotated[bool, typer.Option("--json", help="print the report as JSON")]
_S = SelfPromptConfig(num=1)


def _start() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")


def _report(report, json_out: bool) -> None:
    typer.echo(json.dumps(report.to_dict(), indent=2) if json_out else report.summary())


@command()
def distill(
    target: _Target,
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
    chat: Annotated[bool | None, typer.Option("--chat/--no-chat", help=CHAT_HELP)] = _D.chat,
    dtype: _Dtype = "float32",
    json_out: _Json = False,
) -> None:
    """Write the target's own answers to the prompts of --data (self-distilled, on-policy training data)."""
    _start()
    cfg = DistillConfig(**config_fields(DistillConfig, locals(), exclude=tuple(map(str, exclude or ()))))
    _report(distill_files(target, data, out, cfg, dtype), json_out)


@command("self-prompts")
def self_prompts(
    target: _Target,
    out: Annotated[Path, typer.Option(help="JSONL file of prompts to write (extended until it holds --num)")],
    num: Annotated[int, typer.Option(help="prompts the file should hold")],
    seed: Annotated[int, typer.Option(help="sampling seed (batch b samples with seed + b)")] = _S.seed,
    temperature: Annotated[float, typer.Option(help="sampling temperature")] = _S.temperature,
    top_p: Annotated[float, typer.Option(help="nucleus mass")] = _S.top_p,
    max_new_tokens: Annotated[
        int, typer.Option(help="user-turn length cap; unfinished turns are dropped")
    ] = _S.max_new_tokens,
    batch_size: Annotated[int, typer.Option(help="user turns per generate call")] = _S.batch_size,
    min_words: Annotated[int, typer.Option(help="shorter turns are dropped")] = _S.min_words,
    overlap_words: Annotated[
        int, typer.Option(help="turns sharing a run of this many words with an evaluation prompt are dropped")
    ] = _S.overlap_words,
    system_prompt: Annotated[
        str | None, typer.Option(help="system message before the user turn (default: the template's)")
    ] = _S.system_prompt,
    max_batches: Annotated[int, typer.Option(help="give up after this many batches")] = _S.max_batches,
    dtype: _Dtype = "float32",
    json_out: _Json = False,
) -> None:
    """Let the target write user turns (Magpie, arXiv 2406.08464): prompts for `slimspec distill --data`."""
    _start()
    cfg = SelfPromptConfig(**config_fields(SelfPromptConfig, locals()))
    _report(self_prompt_file(target, out, cfg, dtype), json_out)
