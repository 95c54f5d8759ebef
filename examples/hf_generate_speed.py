"""Speed of transformers' generate() with and without a SlimSpec drafter: the same ``model.generate``
call on SmolLM2-135M-Instruct (float32, CPU), greedy, chat-templated prompts.

    python examples/hf_generate_speed.py --prompts 5 --max-new-tokens 64 --threads 2

Without ``--drafter`` it times the committed demo drafter as loaded (dense head) and converted to a
rank-72 head (plain SVD, no fine-tune). Each prompt runs plain, then with each drafter, back to back
(one untimed warm-up call each first); outputs are checked token for token; tokens/s is total new
tokens over total wall time per way; tau per call is logged.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time
from pathlib import Path

import torch

from slimspec_convert import ConvertConfig, DraftConfig, convert, load_drafter, speculative_generate
from slimspec_convert.decoding.prompts import load_prompts
from slimspec_convert.targets.fetch import get_smollm2
from slimspec_convert.targets.load import load_target

REPO = Path(__file__).resolve().parents[1]


def load_drafters(model, paths: list[Path], tmp: str) -> dict:
    """name -> drafter in the target's dtype; no paths: the demo drafter, dense and converted to r=72."""
    if not paths:
        demo = REPO / "drafters" / "smollm2-135m-eagle3"
        convert(demo, Path(tmp) / "r72", ConvertConfig(rank=72, target=str(get_smollm2())))
        paths = [demo, Path(tmp) / "r72"]
    out = {}
    for path in paths:
        drafter, _ = load_drafter(path, model)
        out[path.name] = drafter.to(model.dtype).eval()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--drafter", type=Path, action="append", default=[], help="drafter folder (repeatable)")
    ap.add_argument("--draft", default="tree", help="tree or chain (DraftConfig defaults otherwise)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    logging.basicConfig(format="%(message)s")
    logging.getLogger("slimspec_convert.decoding.hf_generate").setLevel(logging.INFO)  # tau per call
    model, tok = load_target(get_smollm2(), "float32")
    with tempfile.TemporaryDirectory() as tmp:
        drafters = load_drafters(model, args.drafter, tmp)
    questions = [p[0] for p in load_prompts(REPO / "examples" / "demo_prompts.jsonl")][: args.prompts]
    greedy = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    ways = {"plain": {}}
    for name, drafter in drafters.items():
        ways[name] = dict(
            custom_generate=speculative_generate, drafter=drafter, draft=DraftConfig(args.draft)
        )
    totals = {name: [0, 0.0] for name in ways}
    for i, q in enumerate(questions):
        text = tok.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        inputs = tok(text, return_tensors="pt", add_special_tokens=False)
        outs = {}
        for name, kw in ways.items():
            if i == 0:  # warm-up, not timed
                model.generate(**inputs, max_new_tokens=8, do_sample=False, **kw)
            t0 = time.perf_counter()
            outs[name] = model.generate(**inputs, **greedy, **kw)
            totals[name][1] += time.perf_counter() - t0
            totals[name][0] += outs[name].shape[1] - inputs["input_ids"].shape[1]
            assert torch.equal(outs[name], outs["plain"]), f"prompt {i}, {name}: outputs differ"
    load = os.getloadavg()[0]
    for name, (n, secs) in totals.items():
        print(f"{name:24s} {n} new tokens in {secs:.1f} s: {n / secs:.2f} tokens/s")
    print(f"identical outputs on {len(questions)} prompts; 1-min load average at the end {load:.1f}")


if __name__ == "__main__":
    main()
