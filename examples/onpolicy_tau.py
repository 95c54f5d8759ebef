"""Held-out generation tau (greedy chain-k, real speculative decoding) beside the on-policy prediction.

Held-out prompts: ``data/heldout/general24.jsonl``, the last 10 Self-Instruct user-oriented
instructions, the last 10 OASST prompt-lottery prompts and the last 4 GSM8K training questions; no
distilled training file holds them (``slimspec distill --exclude data/heldout/general24.jsonl``) and
none is an evaluation prompt.
Usage: python examples/onpolicy_tau.py DEPTH OUT.json NAME=PATH[:RERANK_K] ...
The environment variable ``PROMPTS`` names another prompt file (e.g. ``data/heldout/writing24.jsonl``,
or prompts the drafter was trained on, to tell under-fitting from over-fitting); ``MEASURE=0`` skips
the measured (decoded) tau and reports the prediction alone.
"""

import json
import os
import sys
import time

import torch

from slimspec_convert.checkpoint.load import load_drafter
from slimspec_convert.data.distill import read_prompts
from slimspec_convert.measure.chain_acceptance import (
    build_onpolicy_eval,
    chain_acceptance,
    measured_chain_tau,
)
from slimspec_convert.targets.fetch import get_smollm2
from slimspec_convert.targets.forward import resolve_aux_layers
from slimspec_convert.targets.load import load_target

torch.set_num_threads(2)
depth, out = int(sys.argv[1]), sys.argv[2]
model, tok = load_target(get_smollm2(), "float32")
prompt_file = os.environ.get("PROMPTS", "data/heldout/general24.jsonl")
prompts = [r.messages[-1][1] for r in read_prompts([prompt_file])]
measure = os.environ.get("MEASURE", "1") != "0"
ev, rows = None, []
for spec in sys.argv[3:]:
    name, path = spec.split("=", 1)
    rerank = 0
    if ":" in path:
        path, rerank = path.split(":")
        rerank = int(rerank)
    d, _ = load_drafter(path, target=model)
    d = d.float().eval()
    if ev is None:
        ev = build_onpolicy_eval(model, tok, prompts, resolve_aux_layers(d.config, model), max_new_tokens=64)
    if rerank:
        d.enable_rerank(rerank)
    t0 = time.time()
    ca = chain_acceptance(d, ev, depth)
    meas = measured_chain_tau(model, tok, d, prompts, depth, 64) if measure else None
    row = {
        "name": name,
        "path": path,
        "rerank": rerank,
        "predicted": round(ca.predicted_tau, 4),
        "visited": round(ca.visited_tau, 4),
        "measured": meas and round(meas, 4),
        "pred/meas": meas and round(ca.predicted_tau / meas, 4),
        "visited/meas": meas and round(ca.visited_tau / meas, 4),
        "a": [round(x, 3) for x in ca.step_rates],
        "seconds": round(time.time() - t0),
    }
    rows.append(row)
    print(json.dumps(row), flush=True)
json.dump(
    {"depth": depth, "prompts": prompt_file, "num_prompts": len(prompts), "rows": rows},
    open(out, "w"),
    indent=1,
)
