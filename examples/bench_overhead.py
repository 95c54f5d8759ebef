"""Share of decoding wall time spent outside model forward calls (the loop's own Python overhead).

Runs SmolLM2-135M-Instruct (float32, CPU) on MT-Bench first turns with plain decoding, a chain and
a tree, and prints per configuration: wall time, time in target forwards, drafter backbone and
drafter lm_head, and the rest ("overhead": drafting bookkeeping, tree construction, masks,
accept/reject, cache rollback, commits), as a share of wall time and in ms per cycle.

    python examples/bench_overhead.py --prompts 4 --max-new-tokens 48 --threads 2

Without ``--drafter`` a random drafter of SmolLM2's shape is used (acceptance near zero, which is
the worst case for overhead per committed token); ``--rank`` gives it a low-rank head.
"""

from __future__ import annotations

import argparse
import time

import torch

from slimspec_convert.checkpoint.load import load_drafter
from slimspec_convert.decoding.config import DraftConfig, SamplingConfig
from slimspec_convert.decoding.generator import SpeculativeGenerator
from slimspec_convert.decoding.prompts import load_prompts
from slimspec_convert.model.config import DrafterConfig
from slimspec_convert.model.drafter import Eagle3Drafter
from slimspec_convert.targets.fetch import get_smollm2
from slimspec_convert.targets.load import load_target

MT_BENCH = "data/eval/mt_bench/question.jsonl"


def random_drafter(model, rank: int | None) -> Eagle3Drafter:
    torch.manual_seed(0)
    cfg = DrafterConfig(
        hidden_size=576,
        intermediate_size=1536,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        draft_vocab_size=49152,
        aux_layer_ids=(2, 15, 27),
        head_rank=rank,
    )
    drafter = Eagle3Drafter(cfg).eval()
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(model.get_input_embeddings().weight)
    return drafter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4, help="MT-Bench first turns")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--drafter", default=None, help="drafter folder (default: random, SmolLM2 shape)")
    ap.add_argument("--rank", type=int, default=None, help="random drafter: low-rank head of this rank")
    ap.add_argument("--batch-size", type=int, default=1)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_target(get_smollm2(), "float32")
    drafter = (
        load_drafter(args.drafter, target=model)[0].eval()
        if args.drafter
        else random_drafter(model, args.rank)
    )
    prompts = [t[0] for t in load_prompts(MT_BENCH)][: args.prompts]
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens)
    configs = {
        "plain": (None, None),
        "chain k=3": (drafter, DraftConfig(method="chain", depth=3)),
        "tree 5/4/16": (drafter, DraftConfig()),
    }
    print(
        f"SmolLM2-135M fp32, {torch.get_num_threads()} threads, {len(prompts)} prompts x "
        f"{args.max_new_tokens} tokens, batch {args.batch_size}; times are sums over prompts"
    )
    print(
        f"{'config':<12} {'wall ms':>9} {'target':>8} {'backbone':>8} {'head':>7} {'overhead':>8} "
        f"{'share':>6} {'ms/cycle':>8} {'cycles':>6} {'tau':>5}"
    )
    for name, (d, draft) in configs.items():
        gen = SpeculativeGenerator(model, tokenizer, d, draft, sampling, batch_size=args.batch_size)
        gen.generate(prompts[:1])  # warm-up
        t0 = time.perf_counter()
        results = gen.generate(prompts)
        wall = (time.perf_counter() - t0) * 1e3
        # Batch rows share their batch's clock: count each batch once (its slowest row).
        batches = [results[i : i + args.batch_size] for i in range(0, len(results), args.batch_size)]
        last = [max(b, key=lambda r: r.stats.wall_ms).stats for b in batches]
        target = sum(s.target_ms for s in last)
        backbone = sum(s.drafter_backbone_ms for s in last)
        head = sum(s.drafter_head_ms for s in last)
        inner = sum(s.wall_ms for s in last)
        overhead = inner - target - backbone - head
        cycles = sum(max(r.stats.cycles for r in b) for b in batches)
        committed = sum(sum(r.stats.committed_per_cycle) for r in results)
        tau = committed / max(sum(r.stats.cycles for r in results), 1)
        print(
            f"{name:<12} {wall:9.0f} {target:8.0f} {backbone:8.0f} {head:7.0f} {overhead:8.0f} "
            f"{overhead / inner:6.1%} {overhead / max(cycles, 1):8.2f} {cycles:6d} {tau:5.2f}"
        )


if __name__ == "__main__":
    main()
