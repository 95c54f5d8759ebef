"""Real speculative tau of a reranked low-rank head beside the dense head it replaces.

Greedy tree decoding (default shape 5x4/16, float32) of held-out prompts with the dense drafter,
then with the low-rank drafter at each ``K:C`` (``enable_rerank(K, context=C)``: the top-K
preview rows rescored exactly, plus the last C distinct tokens of each sequence; C = 0 the top-K
alone). Prints tau (new tokens per round) and its ratio to the dense head's; every output must
equal the dense run's (lossless), else it stops.

Usage (after ``bash examples/quickstart.sh``, which writes the fine-tuned head):
    python examples/rerank_tau.py --low runs/quickstart/slimspec-r72-ft \
        [--prompts data/heldout/writing24.jsonl] [--variants 64:0,64:512,128:512]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from slimspec_convert.checkpoint.load import load_drafter
from slimspec_convert.data.distill import read_prompts
from slimspec_convert.decoding.config import DraftConfig, SamplingConfig
from slimspec_convert.decoding.generator import SpeculativeGenerator
from slimspec_convert.targets.load import load_target

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(Path.home() / ".cache/slimspec/SmolLM2-135M-Instruct"))
    ap.add_argument("--dense", default=str(REPO / "drafters/smollm2-135m-eagle3"))
    ap.add_argument("--low", required=True, help="low-rank drafter folder (head from the embedding)")
    ap.add_argument("--prompts", default=str(REPO / "data/heldout/writing24.jsonl"))
    ap.add_argument("--variants", default="64:0,64:512,128:512", help="comma-separated K:C")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_target(args.target, "float32")
    prompts = [r.messages[-1][1] for r in read_prompts([args.prompts])]

    def tau(drafter) -> tuple[float, list[list[int]]]:
        sampling = SamplingConfig(max_new_tokens=args.max_new_tokens)
        res = SpeculativeGenerator(model, tok, drafter, DraftConfig(), sampling).generate(prompts)
        new, rounds = sum(r.stats.new_tokens for r in res), sum(r.stats.cycles for r in res)
        return new / rounds, [r.output_ids for r in res]

    dense, _ = load_drafter(args.dense, target=model)
    low, _ = load_drafter(args.low, target=model)
    rows = {"dense": tau(dense.float().eval())}
    low = low.float().eval()
    for v in args.variants.split(","):
        k, c = (int(x) for x in v.split(":"))
        low.enable_rerank(k, context=c)
        rows[f"rerank K={k} C={c}"] = tau(low)
        if rows[f"rerank K={k} C={c}"][1] != rows["dense"][1]:
            raise SystemExit(f"{v}: outputs differ from the dense drafter's (not lossless)")
    ref = rows["dense"][0]
    table = {name: {"tau": round(t, 3), "ratio": round(t / ref, 3)} for name, (t, _) in rows.items()}
    print(json.dumps({"prompts": args.prompts, "num_prompts": len(prompts), "rows": table}, indent=1))


if __name__ == "__main__":
    main()
