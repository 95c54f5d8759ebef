"""CLI command ``slimspec generate`` (registered on slimspec_convert.cli.app)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from .cli import USER_ERRORS, app, fail
from .config import DraftConfig, GenerateConfig, SamplingConfig

_D, _S, _G = DraftConfig(), SamplingConfig(), GenerateConfig()


@app.command()
def generate(
    target: Annotated[str, typer.Option(help="target: HF folder, .gguf file or hub id")],
    drafter: Annotated[
        str, typer.Option(help="drafter folder (any EAGLE-3 layout), or 'none' for the target alone")
    ],
    prompt: Annotated[str | None, typer.Option(help="one prompt")] = None,
    prompts: Annotated[Path | None, typer.Option(help="JSONL with 'prompt' or MT-Bench 'turns'")] = None,
    chat: Annotated[
        bool, typer.Option("--chat/--no-chat", help="apply the target's chat template")
    ] = _G.chat,
    system_prompt: Annotated[
        str | None, typer.Option(help="system message (default: the template's)")
    ] = None,
    all_turns: Annotated[
        bool, typer.Option("--all-turns", help="run every MT-Bench turn as a conversation")
    ] = False,
    limit: Annotated[int | None, typer.Option(help="use only the first N prompts of --prompts")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="new tokens per prompt at most")] = _S.max_new_tokens,
    temperature: Annotated[
        float, typer.Option(help="0 = greedy; > 0 = lossless speculative sampling")
    ] = _S.temperature,
    top_p: Annotated[float, typer.Option(help="nucleus mass P (0 < P <= 1)")] = _S.top_p,
    seed: Annotated[int, typer.Option(help="sampling seed (each prompt gets its own generator)")] = _S.seed,
    draft: Annotated[str, typer.Option(help="tree (EAGLE-2/3 dynamic tree) or chain")] = _D.method,
    depth: Annotated[int, typer.Option(help="draft depth; for a chain, k tokens per round")] = _D.depth,
    top_k: Annotated[
        int, typer.Option(help="tree: nodes expanded per level and children per node")
    ] = _D.top_k,
    total_tokens: Annotated[
        int, typer.Option(help="tree: draft nodes verified per round (root excluded)")
    ] = (_D.total_tokens),
    batch_size: Annotated[int, typer.Option(help="prompts decoded together (left-padded)")] = _G.batch_size,
    rerank: Annotated[
        int,
        typer.Option(help="low-rank head: rescore its top-K logits with the embedding rows (0 = off)"),
    ] = 0,
    dtype: Annotated[
        str, typer.Option(help="target and drafter dtype: float32, bfloat16, float16")
    ] = _G.dtype,
    threads: Annotated[int | None, typer.Option(help="torch CPU threads (default: torch's)")] = None,
    json_out: Annotated[
        bool, typer.Option("--json", help="print one JSON list, one object per prompt")
    ] = False,
) -> None:
    """Generate with the target alone or with an EAGLE-3 drafter (greedy output = the target's)."""
    try:
        if threads is not None:
            if threads < 1:
                raise ValueError(f"--threads={threads}: expected >= 1")
            import torch

            torch.set_num_threads(threads)
        if (prompt is None) == (prompts is None):
            raise ValueError("give exactly one of --prompt TEXT or --prompts FILE.jsonl")
        gcfg = GenerateConfig(
            chat=chat,
            system_prompt=system_prompt,
            all_turns=all_turns,
            batch_size=batch_size,
            dtype=dtype,
            max_prompts=limit,
        )
        dcfg = DraftConfig(method=draft, depth=depth, top_k=top_k, total_tokens=total_tokens)
        scfg = SamplingConfig(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, seed=seed)
        results = _run(target, drafter, prompt, prompts, gcfg, dcfg, scfg, rerank)
    except USER_ERRORS as err:
        fail(err)
    if json_out:
        typer.echo(json.dumps([r.to_dict() for r in results], indent=1))
        return
    _print_results(results)


def _run(
    target,
    drafter,
    prompt,
    prompts,
    gcfg: GenerateConfig,
    dcfg: DraftConfig,
    scfg: SamplingConfig,
    rerank: int = 0,
):
    from .convert import load_drafter
    from .generate import SpeculativeGenerator
    from .prompts import load_prompts
    from .target import load_target

    turns = [(prompt,)] if prompt is not None else load_prompts(prompts, all_turns=gcfg.all_turns)
    if gcfg.max_prompts is not None:
        turns = turns[: gcfg.max_prompts]
    model, tokenizer = load_target(target, gcfg.dtype)
    module = None
    if drafter.lower() != "none":
        module, _ = load_drafter(drafter, target=model)
        module.to(model.dtype).eval()  # one dtype for both models (--dtype)
        if rerank:
            try:
                module.enable_rerank(rerank)
            except ValueError as e:
                raise ValueError(f"--rerank {rerank}: {drafter}: {e}") from e
    elif rerank:
        raise ValueError("--rerank needs a low-rank --drafter")
    gen = SpeculativeGenerator(
        model,
        tokenizer,
        module,
        dcfg,
        scfg,
        chat=gcfg.chat,
        system_prompt=gcfg.system_prompt,
        batch_size=gcfg.batch_size,
    )
    if gcfg.all_turns:
        return [r for conv in gen.generate_conversations(turns) for r in conv]
    return gen.generate([t[0] for t in turns])


def _print_results(results) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title="slimspec generate (tau = accepted drafts + 1 bonus per target verification)")
    for col in (
        "#",
        "prompt",
        "new tokens",
        "cycles",
        "tau",
        "tokens/s",
        "target ms",
        "drafter ms",
        "head ms",
    ):
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
        )
    console.print(table)
