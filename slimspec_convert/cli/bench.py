"""CLI commands: ``bench head``, ``bench e2e``, ``bench vllm``, ``trim``, ``rank-sweep``."""

from __future__ import annotations

import importlib.util
import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from slimspec_convert.cli.app import (
    CHAT_HELP,
    LINEAR_PRODUCT_HELP,
    LOOKUP_HELP,
    LOOKUP_MAX_HELP,
    LOOKUP_MIN_HELP,
    RERANK_CONTEXT_HELP,
    bench_app,
    command,
    config_fields,
    csv_ints,
    csv_items,
    default,
)
from slimspec_convert.measure.e2e import BenchE2EConfig
from slimspec_convert.measure.head_latency import BenchHeadConfig, HeadBenchRow, bench_head
from slimspec_convert.measure.machine import MachineState
from slimspec_convert.measure.tables import e2e_markdown, fmt_number
from slimspec_convert.workflows.bench import bench_e2e, head_shapes
from slimspec_convert.workflows.rank_sweep import RankSweepConfig, rank_sweep, sweep_markdown
from slimspec_convert.workflows.trim import TrimConfig, trim_checkpoint

_HEAD, _SWEEP = BenchHeadConfig(), RankSweepConfig()
_DTYPE_HELP = "auto (bf16 on CUDA, fp32 on CPU), fp32, bf16 or fp16"
_DEVICE_HELP = "auto (cuda when available), cpu, cuda or cuda:N"


def _csv(values: tuple) -> str:
    return ",".join(str(v) for v in values)


@command("head", on=bench_app)
def bench_head_cmd(
    hidden_size: Annotated[int | None, typer.Option(help="d of one head shape (with --vocab-size)")] = None,
    vocab_size: Annotated[int | None, typer.Option(help="V of one head shape (with --hidden-size)")] = None,
    drafter: Annotated[
        Path | None, typer.Option(help="time this drafter's head shape (its config.json)")
    ] = None,
    ranks: Annotated[str, typer.Option(help="comma list of ranks or d/N, e.g. 512,d/16")] = _csv(_HEAD.ranks),
    batch_sizes: Annotated[str, typer.Option(help="comma list of batch sizes (tokens per call)")] = _csv(
        _HEAD.batch_sizes
    ),
    dtype: Annotated[str, typer.Option(help="bf16, fp16 or fp32")] = _HEAD.dtype,
    trimmed_rows: Annotated[
        int, typer.Option(help="rows of the trimmed head (0 = skip)")
    ] = _HEAD.trimmed_rows,
    repeats: Annotated[int, typer.Option(help="most timed interleaved rounds")] = _HEAD.repeats,
    warmup: Annotated[int, typer.Option(help="untimed warm-up rounds")] = _HEAD.warmup,
    budget_s: Annotated[float, typer.Option(help="timed seconds per shape and batch size")] = _HEAD.budget_s,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda")] = _HEAD.device,
    json_out: Annotated[bool, typer.Option("--json", help="print rows as JSON")] = False,
) -> None:
    """Latency of the full, low-rank and trimmed LM heads (median of interleaved runs, same-run ratios)."""
    cfg = BenchHeadConfig(
        **config_fields(
            BenchHeadConfig,
            locals(),
            shapes=head_shapes(drafter, hidden_size, vocab_size),
            ranks=csv_items(ranks, "--ranks"),
            batch_sizes=csv_ints(batch_sizes, "--batch-sizes"),
        )
    )
    rows = bench_head(cfg, progress=lambda line: typer.echo(line, err=True))
    _warn_busy([r.machine for r in rows])
    if json_out:
        typer.echo(json.dumps([r.to_dict() for r in rows], indent=2))
        return
    _print_head_rows(rows)
    load = rows[-1].machine.load_1m if rows[-1].machine else None
    typer.echo(
        f"ideal = d V / (r (d + V)) (FLOPs and weight bytes); module/bare = LowRankHead / two bare matmuls; "
        f"1-min load average {fmt_number(load, 2)}"
    )


def _warn_busy(states: list[MachineState | None]) -> None:
    """One stderr line per distinct reason the machine counted as busy during a benchmark."""
    reasons = dict.fromkeys(s.reason for s in states if s is not None and s.busy)
    for reason in reasons:
        typer.echo(f"warning: busy machine ({reason}): timings are noisy; rerun on a quiet machine", err=True)


def _print_head_rows(rows: list[HeadBenchRow]) -> None:
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
            fmt_number(r.full_ms),
            fmt_number(r.lowrank_ms),
            f"{r.speedup:.2f}x",
            f"{r.ideal_speedup:.2f}x",
            f"{r.matmul_speedup:.2f}x",
            f"{r.lowrank_overhead:.3f}",
            fmt_number(r.trimmed_ms),
            str(r.repeats),
        )
    console = Console()
    if not console.is_terminal:  # piped output: do not squeeze the table into 80 columns
        console = Console(width=200)
    console.print(table)


@command("trim")
def trim_cmd(
    src: Annotated[Path, typer.Argument(help="full-vocabulary (or trimmed) SlimSpec drafter folder")],
    out: Annotated[Path, typer.Argument(help="output folder")],
    draft_vocab_size: Annotated[int, typer.Option(help="N, target ids to keep")],
    data: Annotated[list[Path], typer.Option(help="calibration JSONL/JSON file (repeatable)")],
    target: Annotated[str, typer.Option(help="target folder, .gguf or hub id (its tokenizer counts tokens)")],
    max_length: Annotated[int, typer.Option(help="tokens per conversation")] = default(
        TrimConfig, "max_length"
    ),
    dtype: Annotated[str | None, typer.Option(help="cast the written weights (bf16, fp16, fp32)")] = default(
        TrimConfig, "dtype"
    ),
    force: Annotated[bool, typer.Option(help="overwrite an existing drafter in OUT")] = default(
        TrimConfig, "force"
    ),
    json_out: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
) -> None:
    """Static vocabulary trimming baseline: keep the N most frequent target tokens (EAGLE-3 d2t/t2d)."""
    cfg = TrimConfig(**config_fields(TrimConfig, locals(), data=tuple(str(p) for p in data)))
    report = trim_checkpoint(src, out, cfg)
    typer.echo(json.dumps(report.to_dict(), indent=2) if json_out else report.summary())


@command("rank-sweep")
def rank_sweep_cmd(
    target: Annotated[str, typer.Option(help="target folder, .gguf or hub id")],
    drafter: Annotated[Path, typer.Option(help="SlimSpec drafter folder with a dense head")],
    data: Annotated[list[Path], typer.Option(help="held-out conversations JSONL/JSON (repeatable)")],
    out: Annotated[Path, typer.Option(help="output folder for JSON, markdown and PNGs")],
    ranks: Annotated[str, typer.Option(help="comma list of ranks or d/N")] = _csv(_SWEEP.ranks),
    kappa: Annotated[
        float | None, typer.Option(help="full head / rest of a step; measured if omitted")
    ] = _SWEEP.kappa,
    num_draft_tokens: Annotated[
        int, typer.Option(help="k of the chain model alpha -> tau")
    ] = _SWEEP.num_draft_tokens,
    max_examples: Annotated[int, typer.Option(help="held-out conversations used")] = _SWEEP.max_examples,
    max_length: Annotated[int, typer.Option(help="tokens per conversation")] = _SWEEP.max_length,
    dtype: Annotated[str, typer.Option(help=_DTYPE_HELP)] = _SWEEP.dtype,
    device: Annotated[str, typer.Option(help=_DEVICE_HELP)] = _SWEEP.device,
    repeats: Annotated[int, typer.Option(help="timed rounds per latency")] = _SWEEP.repeats,
    finetune_steps: Annotated[
        int, typer.Option(help="head fine-tune steps per rank (0 = SVD only)")
    ] = _SWEEP.finetune_steps,
    finetune_data: Annotated[
        list[Path] | None, typer.Option(help="training conversations for --finetune-steps (repeatable)")
    ] = None,
    rerank: Annotated[
        int, typer.Option(help="measure every low-rank head with the shortlist rerank of its top k (0 = off)")
    ] = _SWEEP.rerank,
    acceptance: Annotated[
        str, typer.Option(help="alpha of the chain model: sampling (expected acceptance) or greedy (top-1)")
    ] = _SWEEP.acceptance,
    calibration_data: Annotated[
        list[Path] | None,
        typer.Option(help="training files: calibrated factors, as convert makes (repeatable)"),
    ] = None,
    calibration_source: Annotated[
        str, typer.Option(help="target (the target answers the prompts) or human (the files' answers)")
    ] = _SWEEP.calibration_source,
    calibration_samples: Annotated[
        int, typer.Option(help="calibration conversations")
    ] = _SWEEP.calibration_samples,
    force: Annotated[bool, typer.Option(help="overwrite results in OUT")] = _SWEEP.force,
    json_out: Annotated[bool, typer.Option("--json", help="print the result as JSON")] = False,
) -> None:
    """Sweep ranks: SVD error, held-out acceptance, head latency, predicted rho_TPS; recommend a rank."""
    cfg = RankSweepConfig(
        **config_fields(
            RankSweepConfig,
            locals(),
            ranks=csv_items(ranks, "--ranks"),
            finetune_data=tuple(str(p) for p in finetune_data or ()),
            calibration_data=tuple(str(p) for p in calibration_data or ()),
        )
    )
    result = rank_sweep(target, drafter, [str(p) for p in data], out, cfg)
    typer.echo(json.dumps(result.to_dict(), indent=2) if json_out else sweep_markdown(result))


def named_values(items: list[str], option: str, value=str) -> tuple[tuple[str, Any], ...]:
    """Parse repeatable ``NAME=VALUE`` options; ``value`` converts VALUE.

    Raises:
        ValueError: an item without ``=``, an empty side, or a VALUE ``value`` refuses.
    """
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


@command("e2e", on=bench_app)
def bench_e2e_cmd(
    target: Annotated[str, typer.Option(help="target folder, .gguf or hub id")],
    drafter: Annotated[list[str], typer.Option(help="NAME=PATH of a drafter (repeatable)")],
    prompts: Annotated[Path, typer.Option(help="JSONL prompts ({'prompt'} or MT-Bench {'turns'})")],
    out: Annotated[Path, typer.Option(help="output folder for JSON, markdown and PNG")],
    max_new_tokens: Annotated[int, typer.Option(help="new tokens per prompt")] = default(
        BenchE2EConfig, "max_new_tokens"
    ),
    batch_size: Annotated[int, typer.Option(help="prompts decoded together")] = default(
        BenchE2EConfig, "batch_size"
    ),
    draft: Annotated[
        str,
        typer.Option(
            help="auto (each drafter's shape and prompt lookup with the highest predicted tokens/s, "
            "planned on held-out prompts and cached), tree or chain"
        ),
    ] = default(BenchE2EConfig, "draft_method"),
    depth: Annotated[
        int | None,
        typer.Option(help="--draft chain or tree: draft steps per round (default: 5); auto plans its own"),
    ] = default(BenchE2EConfig, "depth"),
    auto_prompts: Annotated[
        str | None,
        typer.Option(help="--draft auto: calibration prompts JSONL (default: held-out training prompts)"),
    ] = default(BenchE2EConfig, "auto_prompts"),
    max_prompts: Annotated[int, typer.Option(help="first N prompts of the file")] = default(
        BenchE2EConfig, "max_prompts"
    ),
    reference: Annotated[
        str | None, typer.Option(help="full-head drafter NAME for kappa/nu/rho_tau")
    ] = default(BenchE2EConfig, "reference"),
    rerank: Annotated[
        list[str] | None,
        typer.Option(help="NAME=K: rescore that low-rank drafter's top-K logits exactly (repeatable)"),
    ] = None,
    rerank_context: Annotated[int, typer.Option(help=RERANK_CONTEXT_HELP)] = default(
        BenchE2EConfig, "rerank_context"
    ),
    dtype: Annotated[str, typer.Option(help=_DTYPE_HELP)] = default(BenchE2EConfig, "dtype"),
    device: Annotated[str, typer.Option(help=_DEVICE_HELP)] = default(BenchE2EConfig, "device"),
    linear_product: Annotated[str, typer.Option(help=LINEAR_PRODUCT_HELP)] = default(
        BenchE2EConfig, "linear_product"
    ),
    repeats: Annotated[
        int,
        typer.Option(help="runs per prompt and drafter, interleaved; the fastest is kept (noisy machines)"),
    ] = default(BenchE2EConfig, "repeats"),
    lookup: Annotated[
        int | None,
        typer.Option(
            help=LOOKUP_HELP + " for every drafter (default: planned by --draft auto, off with tree or "
            "chain); any drafter with a lookup adds the row 'lookup' (no drafter)"
        ),
    ] = default(BenchE2EConfig, "lookup"),
    drafter_lookup: Annotated[
        list[str] | None,
        typer.Option(help="NAME=N: that drafter's prompt lookup by hand (repeatable; wins over --lookup)"),
    ] = None,
    lookup_row: Annotated[
        int | None,
        typer.Option(
            help="add the row 'lookup' (the target with prompt lookup alone, N tokens a round) whether or "
            "not a drafter uses the lookup (default: only when one does, with the largest lookup)"
        ),
    ] = default(BenchE2EConfig, "lookup_row"),
    lookup_min_ngram: Annotated[int, typer.Option(help=LOOKUP_MIN_HELP)] = default(
        BenchE2EConfig, "lookup_min_ngram"
    ),
    lookup_max_ngram: Annotated[int, typer.Option(help=LOOKUP_MAX_HELP)] = default(
        BenchE2EConfig, "lookup_max_ngram"
    ),
    chat: Annotated[bool | None, typer.Option("--chat/--no-chat", help=CHAT_HELP)] = default(
        BenchE2EConfig, "chat"
    ),
    force: Annotated[bool, typer.Option(help="overwrite results in OUT")] = default(BenchE2EConfig, "force"),
    json_out: Annotated[bool, typer.Option("--json", help="print the result as JSON")] = False,
) -> None:
    """Plain decoding vs each drafter on the same prompts, interleaved: tau, tokens/s, cost model check."""
    cfg = BenchE2EConfig(
        **config_fields(
            BenchE2EConfig,
            locals(),
            drafters=named_values(drafter, "--drafter"),
            rerank=named_values(rerank or [], "--rerank", int),
            drafter_lookup=named_values(drafter_lookup or [], "--drafter-lookup", int),
            draft_method=draft,
        )
    )
    command = shlex.join(["slimspec", *sys.argv[1:]])
    result = bench_e2e(
        target, prompts, out, cfg, progress=lambda line: typer.echo(line, err=True), command=command
    )
    _warn_busy([result.machine])
    if json_out:
        typer.echo(json.dumps({k: v for k, v in result.to_dict().items() if k != "per_prompt"}, indent=2))
    else:
        typer.echo(e2e_markdown(result))


VLLM_BENCH_MODULE = "slimspec_convert.engines.vllm.bench"


def vllm_python() -> str:
    """The Python that runs the vLLM benchmark: this one when it has vLLM, else the checkout's
    ``.venv-vllm`` (``scripts/setup_vllm.sh``).

    Raises:
        FileNotFoundError: neither has vLLM.
    """
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    venv = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
    if venv.is_file():
        return str(venv)
    raise FileNotFoundError(
        f"{venv}: no vLLM in this environment and no .venv-vllm; run `bash scripts/setup_vllm.sh` first"
    )


@bench_app.command(
    "vllm", context_settings={"allow_extra_args": True, "ignore_unknown_options": True}, add_help_option=False
)
def bench_vllm(ctx: typer.Context) -> None:
    """Plain, full-head and SlimSpec drafters in vLLM: tokens/s, acceptance, lossless check (--help: options).

    Runs ``python -m slimspec_convert.engines.vllm.bench`` with every argument in the environment that
    has vLLM (this one, or .venv-vllm): the library never imports vLLM (STYLE.md section 2).
    """
    if {"-h", "--help"} & set(ctx.args):  # the options need no vLLM: help comes from this Python
        shown = subprocess.run(
            [sys.executable, "-m", VLLM_BENCH_MODULE, "--help"], capture_output=True, text=True
        )
        typer.echo(shown.stdout + shown.stderr, nl=False)
        raise typer.Exit(code=shown.returncode)
    try:
        python = vllm_python()
    except FileNotFoundError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(code=2) from None
    raise typer.Exit(code=subprocess.call([python, "-m", VLLM_BENCH_MODULE, *ctx.args]))
