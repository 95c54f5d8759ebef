"""Real greedy chain-k speculative decoding of drafters on held-out prompt files: tau per file.

The measurement behind a drafter's adoption (docs/gemma3.md): each drafter decodes every prompt of
each file (greedy, float32, ``--new-tokens`` tokens, chain depth ``--depth``), and tau (tokens
committed per verification: accepted drafts + 1) is reported per file and as the prompt-weighted
mean over the files. Decoding is lossless, so tau does not depend on the machine or its load.

    python examples/chain_tau.py OUT.json --target gemma3-270m \
        --prompts data/heldout/gemma3-completions.jsonl --prompts data/heldout/gemma3-pyfunc.jsonl \
        released=drafters/gemma3-270m-eagle3 candidate=runs/candidate

TARGET is a demo target name (``smollm2``, ``gemma3-270m``) or a target folder. Completion prompts
(``{"prompt": ...}`` records of a base target) and chat prompts are read by ``read_prompts``; the
evaluation sets under ``data/eval`` are refused there.
"""

import argparse
import json
import time
from pathlib import Path

import torch

from slimspec_convert.atomic import atomic_write_json
from slimspec_convert.checkpoint.load import load_drafter
from slimspec_convert.data.distill import read_prompts
from slimspec_convert.measure.chain_acceptance import measured_chain_tau
from slimspec_convert.targets.fetch import demo_or_path
from slimspec_convert.targets.load import load_target


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="JSON written here")
    ap.add_argument("drafters", nargs="+", help="NAME=FOLDER, one per drafter")
    ap.add_argument("--target", default="smollm2", help="smollm2, gemma3-270m or a target folder")
    ap.add_argument("--prompts", action="append", required=True, help="held-out prompt file (repeat)")
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = demo_or_path(args.target)
    model, tok = load_target(target, "float32")
    files = {p: [r.messages[-1][1] for r in read_prompts([p])] for p in args.prompts}
    rows = []
    for spec in args.drafters:
        name, _, folder = spec.partition("=")
        if not folder:
            raise SystemExit(f"error: {spec!r}: expected NAME=FOLDER")
        drafter = load_drafter(folder, target=model)[0].float().eval()
        t0, taus = time.time(), {}
        for path, prompts in files.items():
            taus[path] = measured_chain_tau(model, tok, drafter, prompts, args.depth, args.new_tokens)
        n = sum(len(p) for p in files.values())
        mean = sum(taus[p] * len(files[p]) for p in files) / n
        rows.append({"name": name, "folder": folder, "tau": taus, "weighted_mean": mean})
        print(json.dumps({**rows[-1], "seconds": round(time.time() - t0)}), flush=True)
    atomic_write_json(
        args.out,
        {
            "what": f"real greedy chain-{args.depth} speculative decoding, {args.new_tokens} new "
            "tokens, float32; tau = tokens committed per verification",
            "target": str(target),
            "prompts": {p: len(v) for p, v in files.items()},
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
