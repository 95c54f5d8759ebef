"""Training tokens/s of ``train-drafter --train body`` on Gemma 3 270M (V = 262,144): 4 steps after one
warm-up, for the settings that make a 262k-vocabulary KL affordable on a CPU.

The step: 4 completion records of ``data/train/gemma3`` (up to 384 tokens), 4 TTT steps, a new drafter
(head and embeddings the target's, frozen; decoder layer and ``fc`` trained), float32 target, one
thread unless ``--threads``. Settings, one JSON object each (FinetuneConfig fields):

    python examples/gemma_train_speed.py '{}'                                   # full KL over 262,144 rows
    python examples/gemma_train_speed.py '{"loss_vocab": 32768}'                # KL over the top 32k rows
    python examples/gemma_train_speed.py '{"loss_vocab": 32768, "feature_cache": "/tmp/gfc"}'

Prints one JSON line per setting: tokens, seconds, tokens/s, the step losses.
"""

import argparse
import json
import time
from pathlib import Path

import torch

from finetune.config import FinetuneConfig
from finetune.train.init import new_drafter_for_target
from finetune.train.trainer import Trainer
from slimspec_convert.data.examples import load_examples
from slimspec_convert.targets.fetch import get_gemma3_270m
from slimspec_convert.targets.forward import resolve_aux_layers
from slimspec_convert.targets.load import load_target

REPO = Path(__file__).resolve().parents[1]

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("settings", nargs="+", help="JSON objects of FinetuneConfig fields")
ap.add_argument("--threads", type=int, default=1)
ap.add_argument("--steps", type=int, default=4)
args = ap.parse_args()
torch.set_num_threads(args.threads)
model, tok = load_target(get_gemma3_270m(), "float32")
files = sorted((REPO / "data" / "train" / "gemma3").glob("completions-*.jsonl*"))[:1]
examples, _ = load_examples(tok, files, 384)
examples = examples[:256]
for setting in args.settings:
    kw = dict(train="body", batch_size=4, ttt_steps=4, max_length=384, data_source="human")
    kw.update(json.loads(setting))
    cfg = FinetuneConfig.for_new_drafter(**kw)
    drafter = new_drafter_for_target(model)
    aux = resolve_aux_layers(drafter.config, model)
    trainer = Trainer(
        drafter, model, aux, examples, examples[:4], cfg, "/tmp/gemma_train_speed", tok.pad_token_id
    )
    if cfg.feature_cache:
        trainer.prepare_features()  # untimed: built once, reused by every later epoch and run
    trainer.train_step()  # warm-up
    tokens, losses, t0 = 0, [], time.perf_counter()
    for _ in range(args.steps):
        loss, n = trainer.train_step()
        tokens += n
        losses.append(round(loss, 4))
    dt = time.perf_counter() - t0
    row = {"config": kw, "threads": args.threads, "tokens": tokens, "seconds": round(dt, 2)}
    print(json.dumps({**row, "tokens_per_s": round(tokens / dt, 2), "losses": losses}), flush=True)
