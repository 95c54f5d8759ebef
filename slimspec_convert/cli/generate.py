"""CLI command ``slimspec generate``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from slimspec_convert.cli.app import (
    CHAT_HELP,
    LINEAR_PRODUCT_HELP,
    LOOKUP_HELP,
    LOOKUP_MAX_HELP,
    LOOKUP_MIN_HELP,
    RERANK_CONTEXT_HELP,
    command,
)
from slimspec_convert.decoding.config import (
    AUTO_DRAFT,
    DraftConfig,
    GenerateConfig,
    SamplingConfig,
    check_lookup_sampling,
)
from slimspec_convert.decoding.results import GenerationResult
from slimspec_convert.workflows.generate import generate_from_paths

_DRAFT, _SAMPLING, _GEN = DraftConfig(), SamplingConfig(), GenerateConfig()


@command()
def generate(
    ctx: typer.Context,
    target: Annotated[str, typer.Option(help="target: HF folder, .gguf file or hub id")],
    drafter: Annotated[
        str, typer.Option(help="drafter folder (any EAGLE-3 layout), or 'none' for the target alone")
    ],
    prompt: Annotated[str | None, typer.Option(help="one prompt")] = None,
    prompts: Annotated[Path | None, typer.Option(help="JSONL with 'prompt' or MT-Bench 'turns'")] = None,
    chat: Annotated[bool | None, typer.Option("--chat/--no-chat", help=CHAT_HELP)] = _GEN.chat,
    system_prompt: Annotated[
        str | None, typer.Option(help="system message (default: the template's)")
    ] = _GEN.system_prompt,
    all_turns: Annotated[
        bool, typer.Option("--all-turns", help="run every MT-Bench turn as a conversation")
    ] = _GEN.all_turns,
    limit: Annotated[
        int | None, typer.Option(help="use only the first N prompts of --prompts")
    ] = _GEN.max_prompts,
    max_new_tokens: Annotated[
        int, typer.Option(help="new tokens per prompt at most")
    ] = _SAMPLING.max_new_tokens,
    temperature: Annotated[
        float, typer.Option(help="0 = greedy; > 0 = lossless speculative sampling")
    ] = _SAMPLING.temperature,
    top_p: Annotated[float, typer.Option(help="nucleus mass P (0 < P <= 1)")] = _SAMPLING.top_p,
    seed: Annotated[
        int, typer.Option(help="sampling seed (each prompt gets its own generator)")
    ] = _SAMPLING.seed,
    draft: Annotated[
        str,
        typer.Option(
            help="auto (the shape and prompt lookup with the highest predicted tokens/s on this machine, "
            "planned on held-out prompts and cached), tree (EAGLE-2/3 dynamic tree) or chain; "
            "--depth/--top-k/--total-tokens need tree or chain"
        ),
    ] = _GEN.draft_method,
    auto_prompts: Annotated[
        str | None,
        typer.Option(help="--draft auto: calibration prompts JSONL (default: held-out training prompts)"),
    ] = _GEN.auto_prompts,
    depth: Annotated[int, typer.Option(help="draft depth; for a chain, k tokens per round")] = _DRAFT.depth,
    top_k: Annotated[
        int, typer.Option(help="tree: nodes expanded per level and children per node")
    ] = _DRAFT.top_k,
    total_tokens: Annotated[
        int, typer.Option(help="tree: draft nodes verified per round (root excluded)")
    ] = _DRAFT.total_tokens,
    lookup: Annotated[
        int | None,
        typer.Option(
            help=LOOKUP_HELP + "; default: planned by --draft auto, off with tree or chain; with "
            "--drafter none, lookup alone"
        ),
    ] = _GEN.lookup,
    lookup_min_ngram: Annotated[int, typer.Option(help=LOOKUP_MIN_HELP)] = _DRAFT.lookup_min_ngram,
    lookup_max_ngram: Annotated[int, typer.Option(help=LOOKUP_MAX_HELP)] = _DRAFT.lookup_max_ngram,
    batch_size: Annotated[int, typer.Option(help="prompts decoded together (left-padded)")] = _GEN.batch_size,
    rerank: Annotated[
        int,
        typer.Option(help="low-rank head: rescore its top-K logits with the embedding rows (0 = off)"),
    ] = _GEN.rerank,
    rerank_context: Annotated[int, typer.Option(help=RERANK_CONTEXT_HELP)] = _GEN.rerank_context,
    dtype: Annotated[
        str, typer.Option(help="target and drafter dtype: auto (bf16 on CUDA, fp32 on CPU), fp32, bf16, fp16")
    ] = _GEN.dtype,
    device: Annotated[
        str, typer.Option(help="auto (cuda when available), cpu, cuda or cuda:N")
    ] = _GEN.device,
    linear_product: Annotated[str, typer.Option(help=LINEAR_PRODUCT_HELP)] = _GEN.linear_product,
    json_out: Annotated[
        bool, typer.Option("--json", help="print one JSON list, one object per prompt")
    ] = False,
    stream: Annotated[
        bool,
        typer.Option("--stream", help="print tokens as they are committed (one --prompt), then the stats"),
    ] = False,
) -> None:
    """Generate with the target alone or with an EAGLE-3 drafter (greedy output = the target's)."""
    for name in ("depth", "top_k", "total_tokens"):  # given on the command line (typer's own click)
        source = ctx.get_parameter_source(name)
        if draft == AUTO_DRAFT and source is not None and source.name == "COMMANDLINE":
            raise ValueError(
                f"--{name.replace('_', '-')} sets a shape by hand: give --draft chain or --draft tree too"
            )
    gcfg = GenerateConfig(
        draft_method=draft,
        lookup=lookup,
        auto_prompts=auto_prompts,
        chat=chat,
        system_prompt=system_prompt,
        all_turns=all_turns,
        batch_size=batch_size,
        dtype=dtype,
        device=device,
        max_prompts=limit,
        rerank=rerank,
        rerank_context=rerank_context,
        linear_product=linear_product,
    )
    auto = draft == AUTO_DRAFT and drafter.lower() != "none"
    dcfg = DraftConfig(
        method="tree" if draft == AUTO_DRAFT else draft,
        depth=depth,
        top_k=top_k,
        total_tokens=total_tokens,
        lookup=lookup or 0,
        lookup_min_ngram=lookup_min_ngram,
        lookup_max_ngram=lookup_max_ngram,
    )
    scfg = SamplingConfig(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, seed=seed)
    if draft != AUTO_DRAFT and drafter.lower() != "none":
        check_lookup_sampling(dcfg, scfg)  # before the models load
    if stream and json_out:
        raise ValueError("--stream and --json: choose one (--json prints everything at the end)")
    on_text = (lambda text: typer.echo(text, nl=False)) if stream else None
    on_plan = (lambda plan: typer.echo(plan.summary(), err=True)) if auto else None  # one line: the shape
    on_linear = (lambda c: typer.echo(c.summary(), err=True)) if linear_product == "auto" else None
    results = generate_from_paths(
        target,
        drafter,
        prompt,
        prompts,
        gcfg,
        dcfg,
        scfg,
        on_text,
        on_plan,
        on_linear,
        on_mode=lambda mode: typer.echo(mode.summary(), err=True),
    )
    if stream:
        typer.echo("")
        typer.echo(stats_line(results[0]))
        return
    if json_out:
        typer.echo(json.dumps([r.to_dict() for r in results], indent=1))
        return
    _print_results(results)


def stats_line(result: GenerationResult) -> str:
    """One line of a result's statistics (tau with its convention)."""
    s = result.stats
    tau = "-" if s.tau is None else f"{s.tau:.2f}"
    return (
        f"{s.new_tokens} new tokens, {s.cycles} cycles, tau {tau} (accepted drafts + 1 bonus per "
        f"verification), {s.tokens_per_s:.1f} tokens/s, target {s.target_ms:.0f} ms, drafter "
        f"{s.drafter_backbone_ms:.0f} ms, head {s.drafter_head_ms:.0f} ms"
        + (f", {s.lookup_tokens} accepted drafts from the lookup alone" if s.draft.get("lookup") else "")
    )


def _print_results(results: list[GenerationResult]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title="slimspec generate (tau = accepted drafts + 1 bonus per target verification)")
    lookup = any(r.stats.draft.get("lookup") for r in results)
    cols = ["#", "prompt", "new tokens", "cycles", "tau", "tokens/s", "target ms", "drafter ms", "head ms"]
    for col in cols + (["lookup drafts"] if lookup else []):
        table.add_column(col, justify="left" if col == "prompt" else "right")
    for i, r in enumerate(results):
        s = r.stats
        console.rule(f"[{i}] {(r.prompt or '')[:70]}")
        console.print(r.text if r.text is not None else r.output_ids, markup=False, highlight=False)
        table.add_row(
            str(i),
            (r.prompt or "")[:40],
            str(s.new_tokens),
            str(s.cycles),
            "-" if s.tau is None else f"{s.tau:.2f}",
            f"{s.tokens_per_s:.1f}",
            f"{s.target_ms:.0f}",
            f"{s.drafter_backbone_ms:.0f}",
            f"{s.drafter_head_ms:.0f}",
            *([str(s.lookup_tokens)] if lookup else []),
        )
    console.print(table)
    if lookup:
        console.print("lookup drafts: accepted drafts that only the prompt lookup proposed (--lookup)")
