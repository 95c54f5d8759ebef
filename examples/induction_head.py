"""Grow a drafter by a hand-built induction head (``finetune.train.init.add_induction_head``).

The token probe is fitted on the target's greedy answers (128 new tokens) to 48 training-side
prompts no kept stage trained on: self-written prompts 1,101-1,132
(``data/train/self_prompts/smollm2-135m-instruct.jsonl``) and copy-heavy prompts 101-116
(``data/train/copy_prompts/copy-prompts.jsonl``). Then fine-tune the grown folder as usual
(``slimspec finetune --train body``); the model card has the run that made the committed drafter.

    python examples/induction_head.py DRAFTER OUT [ALPHA=5]     # about 3 min on 2 cores
"""

import sys
from pathlib import Path

import torch

from finetune.train.init import add_induction_head, fit_token_probe
from slimspec_convert.checkpoint.load import load_drafter
from slimspec_convert.checkpoint.save import save_drafter
from slimspec_convert.data.distill import read_prompts
from slimspec_convert.measure.chain_acceptance import build_onpolicy_eval
from slimspec_convert.targets.fetch import get_smollm2
from slimspec_convert.targets.forward import resolve_aux_layers
from slimspec_convert.targets.load import load_target

torch.set_num_threads(2)
src, dst = sys.argv[1], Path(sys.argv[2])
alpha = float(sys.argv[3]) if len(sys.argv) > 3 else 5.0
if dst.exists():
    sys.exit(f"error: {dst}: exists; remove it first")
model, tok = load_target(get_smollm2(), "float32")
drafter, _ = load_drafter(src, target=model)
drafter = drafter.float().eval()


def prompts(path: str, lo: int, hi: int) -> list[str]:
    return [r.messages[-1][1] for r in read_prompts([path])][lo:hi]


fit = prompts("data/train/self_prompts/smollm2-135m-instruct.jsonl", 1100, 1132)
fit += prompts("data/train/copy_prompts/copy-prompts.jsonl", 100, 116)
ev = build_onpolicy_eval(model, tok, fit, resolve_aux_layers(drafter.config, model), max_new_tokens=128)
ends = torch.tensor([int(row.nonzero().max()) + 1 for row in ev.answer_mask])  # each row's real length
mask = torch.arange(ev.input_ids.shape[1])[None] < ends[:, None]  # prompt and answer, no padding
probe, top1 = fit_token_probe(drafter, ev.aux_hidden, ev.input_ids, mask)
grown = add_induction_head(drafter, probe, alpha=alpha)
save_drafter(grown, dst, include_head=False)
print(f"{dst}: token probe top-1 {top1:.3f} over {int(mask.sum())} positions; alpha {alpha}")
