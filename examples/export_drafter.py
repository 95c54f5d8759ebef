"""Export a ``slimspec finetune --train body`` (or ``train-drafter --train body``) output as a demo
drafter's folder.

bf16 safetensors without the lm_head and the embeddings (both the target's, borrowed at load time:
``save_drafter(..., include_head=False)``), the finetune's training record kept and a history of
the stages merged into ``config.json``'s ``slimspec`` section; the written folder is loaded back and
every parameter checked equal to the source's, cast to bf16.

TARGET is a demo target name (``smollm2``, the default, or ``gemma3-270m``) or a target folder. When
the target folder carries licence terms (``slimspec fetch gemma3-270m`` copies GEMMA_TERMS.html and
NOTICE.md into it), they are copied into the drafter's folder and a NOTICE.md says what the drafter
is: a drafter trained on a Gemma model's hidden states and outputs is a Model Derivative under the
Gemma Terms of Use, redistributed only with the terms, their use restrictions and such a notice.

    python examples/export_drafter.py OUT DEST HISTORY.json [TARGET]
"""

import json
import shutil
import sys
from pathlib import Path

import torch

from slimspec_convert.checkpoint.load import load_drafter
from slimspec_convert.checkpoint.save import save_drafter
from slimspec_convert.targets.fetch import demo_or_path
from slimspec_convert.targets.load import load_target

GEMMA_NOTICE = """# NOTICE

Gemma is provided under and subject to the Gemma Terms of Use found at ai.google.dev/gemma/terms
(a copy is in GEMMA_TERMS.html, next to this file).

This folder holds an EAGLE-3 drafter for google/gemma-3-270m, trained by SlimSpec on the hidden
states and greedy outputs of Gemma 3 270M (a Model Derivative under the Gemma Terms of Use). It
stores no Gemma weights: the embedding table and the output head are read from the target at load
time. Every file here is new or modified relative to the Gemma release (config.json,
model.safetensors, README.md are SlimSpec's). Use of this drafter is subject to the use restrictions
of the Gemma Terms of Use (the Gemma Prohibited Use Policy, ai.google.dev/gemma/prohibited_use_policy),
which you must pass on to anyone you give it to.

The SlimSpec code that made it is Apache-2.0.
"""

LICENCE_FILES = ("GEMMA_TERMS.html",)

src, dst, history = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(Path(sys.argv[3]).read_text())
target_arg = sys.argv[4] if len(sys.argv) > 4 else "smollm2"
if dst.exists():
    sys.exit(f"error: {dst}: exists; remove it first")
target = demo_or_path(target_arg)
model, _ = load_target(target, "float32")
drafter, _ = load_drafter(src, target=model)
training = json.loads((src / "config.json").read_text())["slimspec"].get("training", {})
extra = {"training": training, "history": history}
save_drafter(drafter, dst, dtype=torch.bfloat16, include_head=False, extra_config=extra)
terms = [Path(target) / f for f in LICENCE_FILES if (Path(target) / f).is_file()]
for f in terms:
    shutil.copyfile(f, dst / f.name)
if terms:
    (dst / "NOTICE.md").write_text(GEMMA_NOTICE)
back, _ = load_drafter(dst, target=model)
want, got = drafter.state_dict(), back.state_dict()
assert want.keys() == got.keys()
for k in want:
    assert torch.equal(want[k].to(torch.bfloat16), got[k].to(torch.bfloat16)), k
size = sum(p.stat().st_size for p in dst.iterdir())
print(f"exported {dst}: {size} bytes, {len(want)} tensors equal after reload; licence files: {len(terms)}")
