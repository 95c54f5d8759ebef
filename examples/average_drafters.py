"""Average two drafter folders of the same architecture, tensor by tensor (a uniform "model soup").

Two fine-tunes of one drafter (for instance the released drafter and a run continued from it on new
text) often average into a drafter that keeps most of what each gained (Wortsman et al. 2022, model
soups). Every floating tensor of ``model.safetensors`` is averaged in float32 and stored in its own
dtype; a tensor equal in both folders is copied bit for bit (so a drafter that borrows nothing and
trains only its decoder layer changes only there); integer and bool tensors (``d2t``, ``t2d``) must
be equal. ``config.json`` is A's, with ``slimspec.averaged_from = [A, B]`` added, and A's other
files (licence terms, notice, model card) are copied, so a Model Derivative's terms travel with it.
The target is not needed: nothing the folders borrow from it is read.

    python examples/average_drafters.py A B OUT [--force]

Errors (exit 2, one line naming the file and the tensor): a folder without ``config.json`` or
``model.safetensors``, tensor names, shapes or dtypes that differ, unequal integer tensors, an OUT
that exists without ``--force``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from slimspec_convert.atomic import staged_folder

WEIGHTS, CONFIG = "model.safetensors", "config.json"


def average_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], where: str) -> dict:
    """The uniform average of two state dicts of the same names, shapes and dtypes.

    Args:
        a, b: name -> tensor (any shapes; floating tensors are averaged in float32 and cast back
            to their dtype, other tensors must be equal).
        where: what to name in errors (e.g. ``"A/model.safetensors vs B/model.safetensors"``).

    Returns:
        name -> tensor, A's names in A's order; a tensor equal in both is A's own, unchanged.

    Raises:
        ValueError: differing names, shapes or dtypes, or an unequal non-floating tensor.
    """
    if a.keys() != b.keys():
        only = sorted(a.keys() ^ b.keys())
        raise ValueError(
            f"{where}: the tensor names differ ({', '.join(only[:3])}{', ...' if len(only) > 3 else ''})"
        )
    out = {}
    for name, x in a.items():
        y = b[name]
        if x.shape != y.shape or x.dtype != y.dtype:
            raise ValueError(
                f"{where}: tensor {name}: {tuple(x.shape)} {x.dtype} vs {tuple(y.shape)} {y.dtype}"
            )
        if torch.equal(x, y):
            out[name] = x
        elif not x.is_floating_point():
            raise ValueError(
                f"{where}: tensor {name} ({x.dtype}) differs; only floating tensors are averaged"
            )
        else:
            out[name] = ((x.float() + y.float()) / 2).to(x.dtype)
    return out


def _read(folder: Path) -> tuple[dict, dict, dict | None]:
    for f in (CONFIG, WEIGHTS):
        if not (folder / f).is_file():
            raise ValueError(f"{folder / f}: not found; a drafter folder holds {CONFIG} and {WEIGHTS}")
    try:
        config = json.loads((folder / CONFIG).read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{folder / CONFIG}: not valid JSON ({e})") from e
    try:
        with safe_open(str(folder / WEIGHTS), "pt") as f:
            metadata = f.metadata()
        return config, load_file(str(folder / WEIGHTS)), metadata
    except SafetensorError as e:
        raise ValueError(f"{folder / WEIGHTS}: not a readable safetensors file ({e})") from e


def average_folders(a: Path, b: Path, out: Path, force: bool = False) -> dict:
    """Write the average of drafter folders ``a`` and ``b`` to ``out`` (built aside, put in place whole).

    Returns:
        {"averaged": tensors that differed, "kept": tensors equal in both}.

    Raises:
        ValueError: see :func:`average_tensors`; a folder without config.json or model.safetensors.
        FileExistsError: ``out`` exists and ``force`` is off.
    """
    config, ta, metadata = _read(a)
    _, tb, _ = _read(b)
    avg = average_tensors(ta, tb, f"{a / WEIGHTS} vs {b / WEIGHTS}")
    config.setdefault("slimspec", {})["averaged_from"] = [str(a), str(b)]
    with staged_folder(out, force) as tmp:
        for f in sorted(a.iterdir()):
            if f.is_file() and f.name not in (CONFIG, WEIGHTS):
                shutil.copyfile(f, tmp / f.name)
        save_file({k: v.contiguous() for k, v in avg.items()}, str(tmp / WEIGHTS), metadata=metadata)
        (tmp / CONFIG).write_text(json.dumps(config, indent=1) + "\n", encoding="utf-8")
    kept = sum(avg[k] is ta[k] for k in avg)
    return {"averaged": len(avg) - kept, "kept": kept}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", type=Path, help="first drafter folder (its config and other files are kept)")
    ap.add_argument("b", type=Path, help="second drafter folder, same architecture")
    ap.add_argument("out", type=Path, help="output folder (must not exist unless --force)")
    ap.add_argument("--force", action="store_true", help="replace an existing OUT")
    args = ap.parse_args(argv)
    try:
        got = average_folders(args.a, args.b, args.out, args.force)
    except (ValueError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.out}: {got['averaged']} tensors averaged, {got['kept']} equal in both and kept")
    return 0


if __name__ == "__main__":
    sys.exit(main())
