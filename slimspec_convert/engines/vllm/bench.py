"""``slimspec bench vllm``: plain, full-head and SlimSpec drafters in vLLM on the same prompts.

For each batch size: tokens/s, vLLM's mean acceptance length and per-position acceptance, and a
lossless check (greedy outputs equal plain vLLM's); beside them, our own engine's tau on the same
prompts and chain depth (greedy, batch 1). Writes ``bench_vllm.json`` and ``bench_vllm.md``.

Runs inside an environment with vLLM (``.venv-vllm``, ``scripts/setup_vllm.sh``), as
``python -m slimspec_convert.engines.vllm.bench ...``; ``slimspec bench vllm`` starts it there.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from slimspec_convert.engines.vllm.run import cpu_env, generate_greedy, make_llm, release_vllm

PLAIN = "plain"


@dataclass(frozen=True)
class BenchVllmConfig:
    """Options of ``slimspec bench vllm``.

    Attributes:
        target: target folder.
        drafters: ``name=folder`` pairs (dense or low-rank EAGLE-3 drafters).
        prompts: JSONL prompt file (``prompt`` or ``turns``; the first turn, chat template applied).
        num_prompts: first N prompts of the file.
        max_new_tokens: new tokens per prompt.
        depth: k, draft tokens per round (a chain; vLLM's ``num_speculative_tokens``).
        batch_sizes: prompts decoded together, one measurement each.
        dtype: model dtype (both engines).
        threads: OpenMP threads for vLLM and torch threads for our engine.
        ours: also measure our engine's tau on the same prompts.
        out: output folder.
    """

    target: str
    drafters: tuple[str, ...]
    prompts: str = "examples/demo_prompts.jsonl"
    num_prompts: int = 8
    max_new_tokens: int = 64
    depth: int = 3
    batch_sizes: tuple[int, ...] = (1, 8)
    dtype: str = "float32"
    threads: int = 2
    ours: bool = True
    out: str = "results/vllm"

    def __post_init__(self) -> None:
        for spec in self.drafters:
            name, sep, path = spec.partition("=")
            if not sep or not name or not path or name == PLAIN:
                raise ValueError(
                    f"BenchVllmConfig.drafters: {spec!r}: expected NAME=FOLDER (NAME not 'plain')"
                )
        for field_name in ("num_prompts", "max_new_tokens", "depth", "threads"):
            if getattr(self, field_name) < 1:
                raise ValueError(f"BenchVllmConfig.{field_name}={getattr(self, field_name)}: expected >= 1")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"BenchVllmConfig.batch_sizes={self.batch_sizes}: expected sizes >= 1")

    def drafter_map(self) -> dict[str, str]:
        """name -> folder, in the order given."""
        return dict(spec.split("=", 1) for spec in self.drafters)


def encode_texts(target: str, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of user prompts after the target's chat template, as our engine encodes them."""
    from slimspec_convert.decoding.prompts import render_chat
    from slimspec_convert.targets.load import load_tokenizer

    tokenizer = load_tokenizer(target)
    return [tokenizer(render_chat(tokenizer, [t], []), add_special_tokens=False)["input_ids"] for t in texts]


def encode_prompts(target: str, prompts_file: str, num_prompts: int) -> tuple[list[str], list[list[int]]]:
    """(the first ``num_prompts`` prompts of a JSONL file, their token ids: :func:`encode_texts`)."""
    from slimspec_convert.decoding.prompts import load_prompts

    texts = [turns[0] for turns in load_prompts(prompts_file)[:num_prompts]]
    return texts, encode_texts(target, texts)


def ours_greedy(
    target: str, drafter: str | None, prompt_ids: Sequence[Sequence[int]], depth: int, max_new_tokens: int
) -> tuple[list[list[int]], float | None]:
    """Our engine, greedy, batch 1, a chain of ``depth``: (outputs, pooled tau).

    tau here is all committed tokens over all verification rounds of all prompts (accepted drafts +
    1 bonus per round; the prefill token is not a round), vLLM's convention for its mean acceptance
    length. None for plain decoding.
    """
    import torch

    from slimspec_convert.checkpoint.load import load_drafter
    from slimspec_convert.decoding.config import DraftConfig, SamplingConfig
    from slimspec_convert.decoding.generator import SpeculativeGenerator
    from slimspec_convert.targets.load import load_target

    model, _tok = load_target(target, dtype="float32")
    model.eval()
    dr = None
    if drafter is not None:
        dr, _ = load_drafter(drafter, model)
        dr = dr.to(torch.float32).eval()
    gen = SpeculativeGenerator(
        model,
        None,
        dr,
        DraftConfig(method="chain", depth=depth),
        SamplingConfig(max_new_tokens=max_new_tokens),
    )
    results = gen.generate([list(p) for p in prompt_ids])
    outputs = [r.output_ids for r in results]
    if dr is None:
        return outputs, None
    committed = sum(sum(r.stats.committed_per_cycle) for r in results)
    cycles = sum(r.stats.cycles for r in results)
    return outputs, committed / cycles if cycles else None


def run_bench(cfg: BenchVllmConfig, command: str = "") -> dict[str, Any]:
    """Measure every drafter (and plain decoding) in vLLM, then our engine; return the JSON record.

    Args:
        cfg: the options.
        command: the command line, recorded with the figures.

    Raises:
        ValueError: a drafter folder vLLM cannot load (vLLM's own message).
    """
    env = cpu_env(cfg.threads)
    machine = _machine(command)
    texts, prompt_ids = encode_prompts(cfg.target, cfg.prompts, cfg.num_prompts)
    rows: list[dict[str, Any]] = []
    plain_outputs: dict[int, list[list[int]]] = {}
    for name, folder in [(PLAIN, None), *cfg.drafter_map().items()]:
        llm = make_llm(cfg.target, folder, num_draft_tokens=cfg.depth, dtype=cfg.dtype)
        generate_greedy(llm, prompt_ids[:1], 4, 1)  # warm-up: first-call allocations
        for bs in cfg.batch_sizes:
            run = generate_greedy(llm, prompt_ids, cfg.max_new_tokens, bs)
            if name == PLAIN:
                plain_outputs[bs] = run.output_ids
            same = [a == b for a, b in zip(run.output_ids, plain_outputs[bs], strict=True)]
            rows.append(
                {
                    "drafter": name,
                    "folder": folder,
                    "batch_size": bs,
                    "tokens_per_s": run.tokens_per_s,
                    "seconds": run.seconds,
                    "new_tokens": run.new_tokens,
                    "lossless": all(same) if name != PLAIN else None,
                    "num_lossless": sum(same),
                    **{f"vllm_{k}": v for k, v in run.counters.to_dict().items()},
                }
            )
        del llm
        release_vllm()
    ours: dict[str, Any] = {}
    if cfg.ours:
        import torch

        torch.set_num_threads(cfg.threads)
        for name, folder in [(PLAIN, None), *cfg.drafter_map().items()]:
            outputs, tau = ours_greedy(cfg.target, folder, prompt_ids, cfg.depth, cfg.max_new_tokens)
            ours[name] = {"tau": tau, "same_as_vllm_plain": outputs == plain_outputs[cfg.batch_sizes[0]]}
    for row in rows:
        row["ours_tau"] = ours.get(row["drafter"], {}).get("tau")
    return {
        "config": asdict(cfg),
        "env": env,
        "machine": {**machine, "load_1m_end": os.getloadavg()[0]},
        "prompts": texts,
        "rows": rows,
        "ours": ours,
    }


def _machine(command: str) -> dict[str, Any]:
    import torch
    import vllm

    from slimspec_convert.version import __version__

    return {
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "vllm": vllm.__version__,
        "slimspec": __version__,
        "cpu_count": os.cpu_count(),
        "load_1m_start": os.getloadavg()[0],
        "command": command,
    }


def table(record: dict[str, Any]) -> str:
    """Markdown table of a :func:`run_bench` record (one row per drafter and batch size)."""
    cfg = record["config"]
    lines = [
        f"vLLM {record['machine']['vllm']}, {cfg['dtype']}, greedy, chain of {cfg['depth']}, "
        f"{len(record['prompts'])} prompts x up to {cfg['max_new_tokens']} new tokens, "
        f"OMP_NUM_THREADS={record['env']['OMP_NUM_THREADS']}; tau = accepted drafts + 1 bonus token per "
        "verification (vLLM: mean acceptance length).",
        "",
        "| drafter | batch | tokens/s | speedup vs plain | vLLM acceptance length | acceptance per position "
        "| our engine's tau | lossless |",
        "|---|---|---|---|---|---|---|---|",
    ]
    plain = {r["batch_size"]: r["tokens_per_s"] for r in record["rows"] if r["drafter"] == PLAIN}
    for r in record["rows"]:
        mal, tau = _fmt(r["vllm_mean_acceptance_length"]), _fmt(r["ours_tau"])
        per_pos = ", ".join(f"{a:.2f}" for a in r["vllm_acceptance_per_pos"]) or "-"
        n_same = r["num_lossless"]
        lossless = "-" if r["lossless"] is None else ("yes" if r["lossless"] else f"no ({n_same} equal)")
        speedup = r["tokens_per_s"] / plain[r["batch_size"]]
        lines.append(
            f"| {r['drafter']} | {r['batch_size']} | {r['tokens_per_s']:.2f} | {speedup:.2f}x | {mal} | "
            f"{per_pos} | {tau} | {lossless} |"
        )
    return "\n".join(lines) + "\n"


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def parse_args(argv: Sequence[str] | None = None) -> tuple[BenchVllmConfig, bool]:
    """Command line -> (:class:`BenchVllmConfig`, force)."""
    d = BenchVllmConfig(target="", drafters=())
    p = argparse.ArgumentParser(prog="slimspec bench vllm", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="target folder")
    p.add_argument("--drafter", action="append", default=[], help="NAME=FOLDER (repeatable)")
    p.add_argument("--prompts", default=d.prompts, help="JSONL prompt file")
    p.add_argument("--num-prompts", type=int, default=d.num_prompts)
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--depth", type=int, default=d.depth, help="chain depth k (num_speculative_tokens)")
    p.add_argument("--batch-sizes", default=",".join(map(str, d.batch_sizes)), help="comma-separated")
    p.add_argument("--dtype", default=d.dtype)
    p.add_argument("--threads", type=int, default=d.threads)
    p.add_argument("--no-ours", action="store_true", help="skip our engine's tau")
    p.add_argument("--out", default=d.out, help="output folder")
    p.add_argument("--force", action="store_true", help="overwrite bench_vllm.json / .md in OUT")
    a = p.parse_args(argv)
    cfg = BenchVllmConfig(
        target=a.target,
        drafters=tuple(a.drafter),
        prompts=a.prompts,
        num_prompts=a.num_prompts,
        max_new_tokens=a.max_new_tokens,
        depth=a.depth,
        batch_sizes=tuple(int(x) for x in a.batch_sizes.split(",") if x),
        dtype=a.dtype,
        threads=a.threads,
        ours=not a.no_ours,
        out=a.out,
    )
    return cfg, a.force


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: run, write JSON and table, print the table. Exit 2 on a user's error."""
    from slimspec_convert.atomic import atomic_write_bytes, atomic_write_json

    try:
        cfg, force = parse_args(argv)
        out = Path(cfg.out)
        if (out / "bench_vllm.json").exists() and not force:
            raise FileExistsError(f"{out / 'bench_vllm.json'}: exists; pass --force to replace it")
    except (ValueError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    args = list(sys.argv[1:] if argv is None else argv)
    record = run_bench(cfg, " ".join(["slimspec bench vllm", *args]))
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "bench_vllm.json", record)
    text = table(record)
    atomic_write_bytes(out / "bench_vllm.md", text.encode())
    print(text, end="")
    print(json.dumps({"written": [str(out / "bench_vllm.json"), str(out / "bench_vllm.md")]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
