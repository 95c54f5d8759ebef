"""Export a ``slimspec finetune --train body`` output as the committed demo drafter's folder.

bf16 safetensors without the lm_head and the embeddings (both the target's, borrowed at load time:
``save_drafter(..., include_head=False)``), the finetune's training record kept and a history of
the stages merged into ``config.json``'s ``slimspec`` section; the written folder is loaded back and
every parameter checked equal to the source's, cast to bf16.

    python examples/export_drafter.py OUT DEST HISTORY.json
"""

import json
import sys
from pathlib import Path

import torch

from slimspec_convert.checkpoint.load import load_drafter
from slimspec_convert.checkpoint.save import save_drafter
from slimspec_convert.targets.fetch import get_smollm2
from slimspec_convert.targets.load import load_target

src, dst, history = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(Path(sys.argv[3]).read_text())
if dst.exists():
    sys.exit(f"error: {dst}: exists; remove it first")
model, _ = load_target(get_smollm2(), "float32")
drafter, _ = load_drafter(src, target=model)
training = json.loads((src / "config.json").read_text())["slimspec"].get("training", {})
extra = {"training": training, "history": history}
save_drafter(drafter, dst, dtype=torch.bfloat16, include_head=False, extra_config=extra)
back, _ = load_drafter(dst, target=model)
want, got = drafter.state_dict(), back.state_dict()
assert want.keys() == got.keys()
for k in want:
    assert torch.equal(want[k].to(torch.bfloat16), got[k].to(torch.bfloat16)), k
size = sum(p.stat().st_size for p in dst.iterdir())
print(f"exported {dst}: {size} bytes, {len(want)} tensors equal after reload")
