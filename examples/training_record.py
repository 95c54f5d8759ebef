"""Write the record of a ``slimspec train-drafter`` / ``finetune`` run as JSON, for its model card.

Reads the run folder (``training_state.pt``, loaded with ``weights_only=True``: held-out history,
kept and initial scores; ``train_log.jsonl``: steps and training tokens/s; ``config.json``: the
recipe and data) and writes the figures ``scripts/make_docs.py`` renders into the drafter's model
card, with the exact command, date and machine.

    python examples/training_record.py RUN OUT.json --command "slimspec train-drafter ..." [--threads N]
"""

import argparse
import json
import platform
from datetime import date
from pathlib import Path

import torch

from slimspec_convert.atomic import atomic_write_json
from slimspec_convert.measure.provenance import host_cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--command", required=True, help="the command that ran it, as a user types it")
    ap.add_argument("--threads", type=int, required=True, help="torch threads the run used")
    args = ap.parse_args()
    state = torch.load(args.run / "training_state.pt", weights_only=True, map_location="cpu")
    history = json.loads(state["history_json"])
    best, before = json.loads(state["best_json"]), json.loads(state["before_json"])
    log = [json.loads(line) for line in (args.run / "train_log.jsonl").read_text().splitlines() if line]
    training = json.loads((args.run / "config.json").read_text())["slimspec"]["training"]
    ft = training["finetune"]
    tokens = int(training["data_stats"].split("; ")[-1].split()[0])  # supervised tokens of the data
    steps = int(state["step"])
    records = int(training["data_stats"].split(" records")[0])
    rec = {
        "command": args.command,
        "date": str(date.today()),
        "machine": host_cpu(),
        "python": platform.python_version(),
        "steps_run": steps,
        "batch_size": ft["batch_size"],
        "records": records,
        "supervised_tokens": tokens,
        "epochs": steps * ft["batch_size"] / records,
        "train_tokens": round(steps * ft["batch_size"] / records * tokens),
        "tokens_per_s": [x for x in log if "tokens_per_s" in x][-1]["tokens_per_s"],
        "tokens_per_s_note": "all tokens of each batch (prefix and completion) per second of training steps, "
        "the last resumed segment",
        "threads": args.threads,
        "metric_depth": ft.get("metric_depth", 3),
        "score_kind": best.get("score_kind"),
        "score_before": before["score"],
        "score_kept": best["score"],
        "kept_step": best["step"],
        "history": [{"step": h["step"], "score": h["score"]} for h in history],
    }
    atomic_write_json(args.out, rec)
    print(json.dumps({k: v for k, v in rec.items() if k != "history"}, indent=1))


if __name__ == "__main__":
    main()
