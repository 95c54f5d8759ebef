"""Held-out top-1 / top-4 agreement with the target: dense head vs a low-rank head vs the same
low-rank head with its top-K rows rescored exactly (``LowRankHead.set_rerank``).

Runs the target and the drafter (training-time-test unroll, 3 steps) over held-out GSM8K and code
conversations (the 5% split ``slimspec finetune`` holds out, seed 0) and compares, at every
supervised position, the target's argmax with each head's top-1 and top-4. About 2 minutes on
2 CPU cores for the default 32 conversations.

Usage (after ``bash examples/quickstart.sh``, which writes the converted drafter):
    python examples/rerank_agreement.py --low runs/quickstart/slimspec-r72 \
        [--low runs/quickstart/slimspec-r72-ft]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from finetune.config import FinetuneConfig
from slimspec_convert.checkpoint.load import load_drafter
from slimspec_convert.data.examples import collate, load_examples, split_heldout
from slimspec_convert.model.ttt import ttt_unroll
from slimspec_convert.targets.forward import target_forward
from slimspec_convert.targets.load import load_target, num_target_layers, target_lm_head

REPO = Path(__file__).resolve().parents[1]
DATA = [REPO / "data/train/gsm8k/train.jsonl", REPO / "data/train/gpteacher/codegen-instruct.json"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(Path.home() / ".cache/slimspec/SmolLM2-135M-Instruct"))
    ap.add_argument("--dense", default=str(REPO / "drafters/smollm2-135m-eagle3"))
    ap.add_argument("--low", action="append", required=True, help="low-rank drafter folder (repeatable)")
    ap.add_argument("--ks", default="16,32,64", help="rerank K values")
    ap.add_argument("--conversations", type=int, default=32)
    args = ap.parse_args()
    ks = [int(k) for k in args.ks.split(",")]

    model, tok = load_target(args.target)
    dense, _ = load_drafter(args.dense, target=model)
    dense = dense.float().eval()
    lows = {p: load_drafter(p, target=model)[0].float().eval() for p in args.low}
    cfg = FinetuneConfig(max_length=256, ttt_steps=3)
    examples, _ = load_examples(tok, DATA, cfg.max_length)
    _, held = split_heldout(examples, cfg.max_eval_fraction, cfg.split_seed)
    held = held[: args.conversations]
    aux = dense.config.resolved_aux_layer_ids(num_target_layers(model))
    lm_head = target_lm_head(model).float()  # [V, d_t]
    heads = {"dense": (dense, 0)} | {f"{p} k={k}": (d, k) for p, d in lows.items() for k in [0, *ks]}
    hits = {name: torch.zeros(3, 2) for name in heads}  # [TTT step, (top-1, top-4)]
    count = torch.zeros(3)
    with torch.no_grad():
        for i in range(0, len(held), 4):
            batch = collate(held[i : i + 4], tok.pad_token_id)
            out = target_forward(model, batch["input_ids"], aux, attention_mask=batch["attention_mask"])
            for drafter_name, drafter in [("dense", dense), *lows.items()]:
                steps = ttt_unroll(drafter, batch["input_ids"], out.aux_hidden.float(), batch["loss_mask"], 3)
                for st in steps:
                    b, t = st.valid.nonzero(as_tuple=True)
                    ref = (out.final_hidden[b, t + st.ref_positions_shift].float() @ lm_head.T).argmax(-1)
                    if drafter_name == "dense":
                        count[st.step] += b.numel()
                    for name, (d, k) in heads.items():
                        if d is not drafter:
                            continue
                        if d.head_is_lowrank:
                            d.enable_rerank(k)
                        top4 = d.logits(st.hidden[b, t]).topk(4, dim=-1).indices
                        hits[name][st.step, 0] += (top4[:, 0] == ref).sum()
                        hits[name][st.step, 1] += (top4 == ref[:, None]).any(-1).sum()
    print(f"{len(held)} held-out conversations, positions per TTT step: {count.int().tolist()}")
    print(f"{'head':<60} " + "  ".join(f"step{s} top1/top4" for s in range(3)))
    for name, h in hits.items():
        rate = h / count[:, None]
        print(f"{name:<60} " + "  ".join(f"   {rate[s, 0]:.3f}/{rate[s, 1]:.3f}" for s in range(3)))


if __name__ == "__main__":
    main()
