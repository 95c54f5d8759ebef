"""The drafter of a ``slimspec finetune`` / ``train-drafter`` run's last saved step, as a folder.

A run's folder holds the checkpoint its held-out score kept; ``training_state.pt`` (written every
``--save-every`` steps and at the end) holds the trainable tensors of the last step. This writes a
drafter folder with the kept checkpoint's frozen tensors and config and the last step's trainable
tensors, ``slimspec.training.last_step`` naming the step. The state is loaded with
``weights_only=True``; OUT is built aside and never replaces a folder without ``--force``.

    python examples/last_step.py RUN OUT [--target gemma3-270m] [--force]

Errors (exit 2, one line): no ``training_state.pt`` or an unreadable one, or a trainable tensor the
run's drafter lacks (a LoRA run: its folder holds the merged weights, use ``--train body``/``full``).
"""

import argparse
import pickle
import sys
from pathlib import Path

import torch

from slimspec_convert.atomic import staged_folder
from slimspec_convert.checkpoint.load import load_drafter
from slimspec_convert.checkpoint.save import save_drafter
from slimspec_convert.targets.fetch import demo_or_path

STATE = "training_state.pt"


def last_step(run: Path, out: Path, target=None, force: bool = False) -> int:
    """Write the last step's drafter of ``run`` to ``out``; returns the step.

    Raises:
        ValueError: a missing or unreadable state file, a trainable tensor the drafter lacks or of
            another shape.
        FileExistsError: ``out`` exists and ``force`` is off.
    """
    path = run / STATE
    if not path.is_file():
        raise ValueError(f"{path}: not found; the run saves it every --save-every steps")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        trainable, step = state["trainable"], int(state["step"])
    except (RuntimeError, pickle.UnpicklingError, EOFError, OSError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a readable training state ({e})") from e
    drafter, _ = load_drafter(run, target=target)
    params = dict(drafter.named_parameters())
    with torch.no_grad():
        for name, t in trainable.items():
            if name not in params or params[name].shape != t.shape:
                raise ValueError(
                    f"{path}: trainable tensor {name!r} {tuple(t.shape)} is not a parameter of the "
                    f"drafter in {run} (a LoRA run stores merged weights: use --train body or full)"
                )
            params[name].copy_(t)
    with staged_folder(out, force) as tmp:
        save_drafter(drafter, tmp, extra_config={"training": {"last_step": step, "run": str(run)}})
    return step


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="the run's --out folder")
    ap.add_argument("out", type=Path, help="output folder (must not exist unless --force)")
    ap.add_argument("--target", help="target to borrow from (smollm2, gemma3-270m or a folder)")
    ap.add_argument("--force", action="store_true", help="replace an existing OUT")
    args = ap.parse_args(argv)
    target = demo_or_path(args.target) if args.target else None
    try:
        step = last_step(args.run, args.out, target, args.force)
    except (ValueError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.out}: the drafter of step {step} of {args.run}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
