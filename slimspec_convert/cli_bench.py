"""CLI commands: ``bench head``, ``trim``, ``rank-sweep`` (registered on slimspec_convert.cli.app)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any

import torch
import typer

from .cli import USER_ERRORS, app, fail

bench_app = typer.Typer(
    help="Benchmarks: LM-head latency and end-to-end speculative decoding.", no_args_is_help=True
)
app.add_typer(bench_app, name="bench")


def _csv(text: str, what: str) -> tuple[str, ...]:
    items = tuple(x.strip() for x in text.split(",") if x.strip())
    if not items:
        raise ValueError(f"{what}={text!r}: expected a comma-separated list")
    return items


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in _csv(text, what))
    except ValueError as e:
        raise ValueError(f"{what}={text!r}: expected comma-separated integers") from e


def _fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


@bench_app.command("head")
def bench_head_cmd(
    hidden_size: Annotated[int | None, typer.Option(help="d of one head shape (with --vocab-size)")] = None,
    vocab_size: Annotated[int | None, typer.Option(help="V of one head shape (with --hidden-size)")] = None,
    drafter: Annotated[
        Path | None, typer.Option(help="time this drafter's head shape (its config.json)")
    ] = None,
    ranks: Annotated[str | None, typer.Option(help="comma list of ranks or d/N, e.g. 512,d/16")] = None,
    batch_sizes: Annotated[str, typer.Option(help="comma list of batch sizes (tokens per call)")] = "1,64",
    dtype: Annotated[str | None, typer.Option(help="bf16 (default), fp16 or fp32")] = None,
    trimmed_rows: Annotated[int | None, typer.Option(help="rows of the trimmed head (0 = skip)")] = None,
    repeats: Annotated[int | None, typer.Option(help="most timed interleaved rounds")] = None,
    warmup: Annotated[int | None, typer.Option(help="untimed warm-up rounds")] = None,
    budget_s: Annotated[float | None, typer.Option(help="timed seconds per shape and batch size")] = None,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda")] = "auto",
    threads: Annotated[int | None, typer.Option(help="torch CPU threads (default: torch's)")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="print rows as JSON")] = False,
) -> None:
    """Latency of the full, low-rank and trimmed LM heads (median of interleaved runs, same-run ratios)."""
    from .bench import bench_head, head_shape_from_config
    from .checkpoint import read_config
    from .config import PAPER_HEAD_SHAPES, BenchHeadConfig

    try:
        if threads is not None:
            torch.set_num_threads(threads)
        if drafter is not None:
            if hidden_size is not None or vocab_size is not None:
                raise ValueError("give --drafter or --hidden-size/--vocab-size, not both")
            shapes = (head_shape_from_config(read_config(drafter), str(drafter / "config.json")),)
        elif (hidden_size is None) != (vocab_size is None):
            raise ValueError("--hidden-size and --vocab-size go together")
        elif hidden_size is not None:
            shapes = ((hidden_size, vocab_size),)
        else:
            shapes = tuple(PAPER_HEAD_SHAPES.values())
        given = {
            "ranks": _csv(ranks, "--ranks") if ranks else None,
            "dtype": dtype,
            "trimmed_rows": trimmed_rows,
            "repeats": repeats,
            "warmup": warmup,
            "budget_s": budget_s,
        }
        cfg = BenchHeadConfig(
            shapes=shapes,
            batch_sizes=_ints(batch_sizes, "--batch-sizes"),
            device=device,
            **{k: v for k, v in given.items() if v is not None},
        )
        rows = bench_head(cfg, progress=lambda line: typer.echo(line, err=True))
    except USER_ERRORS as err:
        fail(err)
    load_1m = os.getloadavg()[0]
    if json_out:
        typer.echo(json.dumps([{**r.to_dict(), "load_1m": load_1m} for r in rows], indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"LM head latency, ms per call (median), {rows[0].device}, {rows[0].threads} threads")
    for col in (
        "d",
        "V",
        "r",
        "batch",
        "dtype",
        "full",
        "low-rank",
        "speedup",
        "ideal",
        "matmul speedup",
        "module/bare",
        f"trimmed {rows[0].trimmed_rows or ''}",
        "rounds",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r.hidden_size),
            str(r.vocab_size),
            str(r.rank),
            str(r.batch_size),
            r.dtype,
            _fmt(r.full_ms),
            _fmt(r.lowrank_ms),
            f"{r.speedup:.2f}x",
            f"{r.ideal_speedup:.2f}x",
            f"{r.matmul_speedup:.2f}x",
            f"{r.lowrank_overhead:.3f}",
            _fmt(r.trimmed_ms),
            str(r.repeats),
        )
    console = Console()
    if not console.is_terminal:  # piped output: do not squeeze the table into 80 columns
        console = Console(width=200)
    console.print(table)
    typer.echo(
        f"ideal = d V / (r (d + V)) (FLOPs and weight bytes); module/bare = LowRankHead / two bare matmuls; "
        f"1-min load average {load_1m:.2f}"
    )


@app.command("trim")
def trim_cmd(
    src: Annotated[Path, typer.Argument(help="full-vocabulary (or trimmed) SlimSpec drafter folder")],
    out: Annotated[Path, typer.Argument(help="output folder")],
    draft_vocab_size: Annotated[int, typer.Option(help="N, target ids to keep")],
    data: Annotated[list[Path], typer.Option(help="calibration JSONL/JSON file (repeatable)")],
    target: Annotated[str, typer.Option(help="target folder, .gguf or hub id (its tokenizer counts tokens)")],
    max_length: Annotated[int | None, typer.Option(help="tokens per conversation")] = None,
    dtype: Annotated[str | None, typer.Option(help="cast the written weights (bf16, fp16, fp32)")] = None,
    force: Annotated[bool, typer.Option(help="overwrite an existing drafter in OUT")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
) -> None:
    """Static vocabulary trimming baseline: keep the N most frequent target tokens (EAGLE-3 d2t/t2d)."""
    from .config import TrimConfig
    from .trim import trim_checkpoint

    try:
        extra = {"max_length": max_length} if max_length is not None else {}
        cfg = TrimConfig(
            draft_vocab_size=draft_vocab_size,
            data=tuple(str(p) for p in data),
            target=target,
            dtype=dtype,
            force=force,
            **extra,
        )
        report = trim_checkpoint(src, out, cfg)
    except USER_ERRORS as err:
        fail(err)
    typer.echo(json.dumps(report.to_dict(), indent=2) if json_out else report.summary())


@app.command("rank-sweep")
def rank_sweep_cmd(
    target: Annotated[str, typer.Option(help="target folder, .gguf or hub id")],
    drafter: Annotated[Path, typer.Option(help="SlimSpec drafter folder with a dense head")],
    data: Annotated[list[Path], typer.Option(help="held-out conversations JSONL/JSON (repeatable)")],
    out: Annotated[Path, typer.Option(help="output folder for JSON, markdown and PNGs")],
    ranks: Annotated[str | None, typer.Option(help="comma list of ranks or d/N (default d/32..d/2)")] = None,
    kappa: Annotated[
        float | None, typer.Option(help="full head / rest of a step; measured if omitted")
    ] = None,
    num_draft_tokens: Annotated[int | None, typer.Option(help="k of the chain model alpha -> tau")] = None,
    max_examples: Annotated[int | None, typer.Option(help="held-out conversations used")] = None,
    max_length: Annotated[int | None, typer.Option(help="tokens per conversation")] = None,
    dtype: Annotated[str | None, typer.Option(help="fp32 (default), bf16 or fp16")] = None,
    repeats: Annotated[int | None, typer.Option(help="timed rounds per latency")] = None,
    threads: Annotated[int | None, typer.Option(help="torch CPU threads (default: torch's)")] = None,
    finetune_steps: Annotated[int, typer.Option(help="head fine-tune steps per rank (0 = SVD only)")] = 0,
    finetune_data: Annotated[
        list[Path] | None, typer.Option(help="training conversations for --finetune-steps (repeatable)")
    ] = None,
    force: Annotated[bool, typer.Option(help="overwrite results in OUT")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="print the result as JSON")] = False,
) -> None:
    """Sweep ranks: SVD error, held-out acceptance, head latency, predicted rho_TPS; recommend a rank."""
    from .config import RankSweepConfig
    from .ranksweep import rank_sweep, sweep_markdown

    try:
        if threads is not None:
            torch.set_num_threads(threads)
        given = {
            "ranks": _csv(ranks, "--ranks") if ranks else None,
            "kappa": kappa,
            "num_draft_tokens": num_draft_tokens,
            "max_examples": max_examples,
            "max_length": max_length,
            "dtype": dtype,
            "repeats": repeats,
        }
        cfg = RankSweepConfig(
            force=force,
            finetune_steps=finetune_steps,
            finetune_data=tuple(str(p) for p in finetune_data or ()),
            **{k: v for k, v in given.items() if v is not None},
        )
        result = rank_sweep(target, drafter, [str(p) for p in data], out, cfg)
    except USER_ERRORS as err:
        fail(err)
    typer.echo(json.dumps(result.to_dict(), indent=2) if json_out else sweep_markdown(result))


def _named(items: list[str], option: str, value=str) -> tuple[tuple[str, Any], ...]:
    """Parse repeatable ``NAME=VALUE`` options; ``value`` converts VALUE (ValueError on bad input)."""
    out = []
    for item in items:
        name, sep, raw = item.partition("=")
        try:
            if not sep or not name or not raw:
                raise ValueError
            out.append((name, value(raw)))
        except ValueError:
            kind = "PATH" if value is str else "K with an integer K"
            raise ValueError(f"{option} {item!r}: expected NAME={kind}") from None
    return tuple(out)


@bench_app.command("e2e")
def bench_e2e_cmd(
    target: Annotated[str, typer.Option(help="target folder, .gguf or hub id")],
    drafter: Annotated[list[str], typer.Option(help="NAME=PATH of a drafter (repeatable)")],
    prompts: Annotated[Path, typer.Option(help="JSONL prompts ({'prompt'} or MT-Bench {'turns'})")],
    out: Annotated[Path, typer.Option(help="output folder for JSON, markdown and PNG")],
    max_new_tokens: Annotated[int | None, typer.Option(help="new tokens per prompt")] = None,
    batch_size: Annotated[int, typer.Option(help="prompts decoded together")] = 1,
    draft: Annotated[str, typer.Option(help="tree or chain")] = "tree",
    max_prompts: Annotated[int | None, typer.Option(help="first N prompts of the file")] = None,
    reference: Annotated[str | None, typer.Option(help="full-head drafter NAME for kappa/nu/rho_tau")] = None,
    rerank: Annotated[
        list[str] | None,
        typer.Option(help="NAME=K: rescore that low-rank drafter's top-K logits exactly (repeatable)"),
    ] = None,
    dtype: Annotated[str, typer.Option(help="fp32 (default), bf16 or fp16")] = "float32",
    threads: Annotated[int | None, typer.Option(help="torch CPU threads (default: torch's)")] = None,
    force: Annotated[bool, typer.Option(help="overwrite results in OUT")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="print the result as JSON")] = False,
) -> None:
    """Plain decoding vs each drafter on the same prompts, interleaved: tau, tokens/s, cost model check."""
    from .bench_e2e import bench_e2e, e2e_markdown
    from .config import BenchE2EConfig

    try:
        if threads is not None:
            torch.set_num_threads(threads)
        given = {"max_new_tokens": max_new_tokens, "max_prompts": max_prompts}
        cfg = BenchE2EConfig(
            drafters=_named(drafter, "--drafter"),
            rerank=_named(rerank or [], "--rerank", int),
            batch_size=batch_size,
            draft_method=draft,
            reference=reference,
            dtype=dtype,
            force=force,
            **{k: v for k, v in given.items() if v is not None},
        )
        result = bench_e2e(target, prompts, out, cfg, progress=lambda line: typer.echo(line, err=True))
    except USER_ERRORS as err:
        fail(err)
    if json_out:
        typer.echo(json.dumps({k: v for k, v in result.to_dict().items() if k != "per_prompt"}, indent=2))
    else:
        typer.echo(e2e_markdown(result))
