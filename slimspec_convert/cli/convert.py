"""CLI commands: ``inspect``, ``convert`` and ``fix-vllm``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from slimspec_convert.checkpoint.engines import engine_support
from slimspec_convert.checkpoint.load import inspect_drafter
from slimspec_convert.cli.app import command, config_fields
from slimspec_convert.workflows.convert import ConvertConfig
from slimspec_convert.workflows.convert import convert as convert_checkpoint
from slimspec_convert.workflows.fix_vllm import fix_vllm as fix_vllm_folder

_D = ConvertConfig()


@command()
def inspect(
    path: Annotated[Path, typer.Argument(help="drafter folder (any EAGLE-3 layout)")],
    target: Annotated[
        str | None, typer.Option(help="target folder (only to resolve aux-layer conventions)")
    ] = None,
    norm_output_semantics: Annotated[
        str,
        typer.Option(
            help="auto | specforge | engine: how to read norm_output (SpecForge <= 0.2.0 or engines)"
        ),
    ] = _D.norm_output_semantics,
    json_out: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
) -> None:
    """Detect a drafter's layout and print its geometry, flags, vocabulary maps, provenance and which
    engines (ours, the transformers drop-in, vLLM with and without the slimspec plugin) load it."""
    report = inspect_drafter(path, target, norm_output_semantics=norm_output_semantics)
    engines = engine_support(path, report)
    if json_out:
        typer.echo(json.dumps({**report.to_dict(), "engines": [e.to_dict() for e in engines]}, indent=2))
        return
    typer.echo(report.summary())
    width = max(len(e.engine) for e in engines)
    for e in engines:
        typer.echo(f"engine {e.engine.ljust(width)}  {'loads' if e.loads else 'no'}: {e.why}")


@command()
def convert(
    src: Annotated[Path, typer.Argument(help="source drafter folder (any EAGLE-3 layout)")],
    out: Annotated[Path, typer.Argument(help="output folder (must not exist unless --force)")],
    rank: Annotated[int | None, typer.Option(help="kept rank r (1 <= r <= min(V_d, d))")] = _D.rank,
    rank_fraction: Annotated[
        float | None, typer.Option(help="r = round(F * d); default d/8")
    ] = _D.rank_fraction,
    energy: Annotated[
        float | None, typer.Option(help="smallest r keeping this share of spectral energy")
    ] = _D.energy,
    target: Annotated[
        str | None, typer.Option(help="target folder: rows for --full-vocab, states for calibration")
    ] = _D.target,
    full_vocab: Annotated[
        bool, typer.Option("--full-vocab", help="trimmed head -> full-vocabulary head")
    ] = _D.full_vocab,
    dtype: Annotated[
        str | None, typer.Option(help="factor dtype: float32, bfloat16, float16 (default: source)")
    ] = _D.dtype,
    svd: Annotated[str, typer.Option(help="auto | exact | randomized")] = _D.svd,
    svd_niter: Annotated[int, typer.Option(help="extra Krylov blocks (randomized SVD)")] = _D.svd_niter,
    norm_output_semantics: Annotated[
        str,
        typer.Option(
            help="auto | specforge | engine: how to read norm_output (SpecForge <= 0.2.0 or engines)"
        ),
    ] = _D.norm_output_semantics,
    calibrate: Annotated[
        bool,
        typer.Option(
            "--calibration/--no-calibration",
            help="with --target: fit the factors to the drafter's real hidden states (minimise the "
            "expected logit error); --no-calibration keeps the plain SVD",
        ),
    ] = _D.calibrate,
    calibration_data: Annotated[
        list[Path] | None,
        typer.Option(
            help="training-format file(s) for the calibration (repeatable; needs --target; default: "
            "64 prompts of data/train GSM8K + GPTeacher codegen)"
        ),
    ] = None,
    calibration_samples: Annotated[
        int, typer.Option(help="conversations drawn from --calibration-data")
    ] = _D.calibration_samples,
    calibration_source: Annotated[
        str,
        typer.Option(
            help="target: the target answers the drawn prompts (greedy; the text drafting runs on); "
            "human: the files' own answers (a file written by `slimspec distill` is used as it is)"
        ),
    ] = _D.calibration_source,
    calibration_token_weight: Annotated[
        float,
        typer.Option(
            help="weigh the head's rows by how often their token is the next token in the calibration "
            "text: w = M * V * p + (1 - M); 0 = every row alike"
        ),
    ] = _D.calibration_token_weight,
    calibration_damp: Annotated[
        float, typer.Option(help="damping of the calibration moment, relative to its mean eigenvalue")
    ] = _D.calibration_damp,
    device: Annotated[
        str, typer.Option(help="calibration pass: auto (cuda when available), cpu, cuda or cuda:N")
    ] = _D.device,
    calibration_dtype: Annotated[
        str, typer.Option(help="target dtype in the calibration pass: auto (bf16 on CUDA, fp32 on CPU)")
    ] = _D.calibration_dtype,
    force: Annotated[bool, typer.Option("--force", help="replace an existing OUT")] = _D.force,
    json_out: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
) -> None:
    """Replace a drafter's lm_head by W_up @ W_down of rank r (truncated SVD) and write an HF folder.

    With --target the factors are calibrated by default: the truncated SVD of W C^(1/2) mapped back,
    where C is the second moment of the drafter's lm_head input on training data (--calibration-data,
    or a built-in slice of data/train): the rank-r head with the smallest expected logit error. The
    plain SVD (no --target, or --no-calibration) accepts almost nothing before a fine-tune; a
    warning on stderr says so.
    """
    cfg = ConvertConfig(
        **config_fields(
            ConvertConfig, locals(), calibration_data=tuple(str(p) for p in calibration_data or ())
        )
    )
    report = convert_checkpoint(src, out, cfg)
    typer.echo(report.to_json() if json_out else report.summary())
    for line in report.warnings:
        typer.echo(f"warning: {line}", err=True)


@command("fix-vllm")
def fix_vllm(
    src: Annotated[Path, typer.Argument(help="drafter folder that vLLM refuses for a format quirk")],
    out: Annotated[Path, typer.Argument(help="output folder (must not exist unless --force)")],
    force: Annotated[bool, typer.Option("--force", help="replace an existing OUT")] = False,
) -> None:
    """Copy a drafter so vLLM loads it: drop an all-zero d2t (and t2d) at full vocabulary, and name the
    plugin's architecture for a low-rank head saved under a dense one.

    SpecForge writes an identity d2t even when the draft vocabulary is the target's; vLLM then stops
    with "no module or parameter named 'draft_id_to_target_id'". Every tensor kept is copied byte for
    byte; the other files unchanged. `slimspec inspect` says whether a folder needs it.
    """
    typer.echo(fix_vllm_folder(src, out, force=force).summary())
