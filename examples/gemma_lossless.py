"""Lossless check on the real Gemma 3 270M: speculative greedy decoding (chain and tree) returns the
plain greedy tokens, on held-out completion prompts and on one prompt longer than the sliding window.

The drafter is ``train-drafter``'s untrained initialisation (the target's logit lens on layer L-3:
head and embeddings the target's), or ``--drafter D``. The long prompt joins held-out prose prompts
until it holds more than 512 tokens (Gemma 3's window), so the sliding layers' masks and the rollback
after rejected drafts are exercised past the window.

    python examples/gemma_lossless.py [--drafter D] [--prompts 8] [--new-tokens 48] [--dtype float32]

Prints one JSON line: per shape, whether every output equals plain decoding, tau, tokens/s.
"""

import argparse
import json
from pathlib import Path

import torch

from finetune.train.init import new_drafter_for_target
from slimspec_convert.checkpoint.load import load_drafter
from slimspec_convert.decoding.config import DraftConfig, SamplingConfig
from slimspec_convert.decoding.generator import SpeculativeGenerator
from slimspec_convert.decoding.prompts import load_prompts
from slimspec_convert.targets.fetch import get_gemma3_270m
from slimspec_convert.targets.load import load_target

REPO = Path(__file__).resolve().parents[1]
WINDOW = 512

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--drafter", default=None)
ap.add_argument("--prompts", type=int, default=8)
ap.add_argument("--new-tokens", type=int, default=48)
ap.add_argument("--dtype", default="float32")
args = ap.parse_args()
model, tok = load_target(get_gemma3_270m(), args.dtype)
if args.drafter:
    drafter, _ = load_drafter(args.drafter, target=model)
else:
    drafter = new_drafter_for_target(model)
drafter = drafter.to(model.dtype).eval()
held = [t[0] for t in load_prompts(REPO / "data" / "heldout" / "gemma3-completions.jsonl")]
step = max(1, len(held) // args.prompts)
prompts = held[::step][: args.prompts]
long_prompt = ""
for p in held:
    long_prompt += p + "\n\n"
    if len(tok(long_prompt)["input_ids"]) > WINDOW + 16:
        break
prompts.append(long_prompt)
sampling = SamplingConfig(max_new_tokens=args.new_tokens)
shapes = {
    "plain": None,
    "chain3": DraftConfig(method="chain", depth=3),
    "tree": DraftConfig(method="tree", depth=4, top_k=3, total_tokens=10),
}
report, reference = {"prompts": len(prompts), "long_prompt_tokens": len(tok(long_prompt)["input_ids"])}, None
with torch.inference_mode():
    for name, shape in shapes.items():
        gen = SpeculativeGenerator(model, tok, None if shape is None else drafter, shape, sampling)
        res = gen.generate(prompts)
        ids = [r.output_ids for r in res]
        if reference is None:
            reference = ids
        tokens = sum(r.stats.new_tokens for r in res)
        seconds = sum(r.stats.wall_ms for r in res) / 1e3
        committed = [c for r in res for c in r.stats.committed_per_cycle]
        report[name] = {
            "identical_to_plain": ids == reference,
            "tau": round(sum(committed) / max(1, len(committed)), 3) if shape is not None else 1.0,
            "tokens_per_s": round(tokens / seconds, 2),
            "new_tokens": tokens,
        }
        print(name, report[name], flush=True)
print(json.dumps(report))
print("first output:", repr(tok.decode(reference[0])[:200]))
