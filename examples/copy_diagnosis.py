"""Where the first draft misses: the drafter against the target's confidence and against copying.

The target (SmolLM2-135M-Instruct, float32) answers the 24 held-out general prompts
(``data/heldout/general24.jsonl``, greedy, ``MAX_NEW`` tokens); the drafter runs teacher-forced on
that text (the on-policy metric of ``slimspec_convert.measure.chain_acceptance``), and its first
draft at each answer position (token ``x_{t+2}`` after the committed ``x_{t+1}``) is compared with
the target's greedy token. Printed, one JSON object:

* ``agree``: the share of positions where the first draft is the target's token (the depth-1
  acceptance of greedy chain drafting, teacher-forced);
* ``by_target_confidence``: that share per bin of the target's own top-1 probability;
* ``copyable``: positions whose bigram ``(x_{t+1}, x_{t+2})`` already occurs earlier in the prompt
  or answer, and the drafter's agreement on them and on the rest;
* ``lookup``: a prompt-lookup predictor (Saxena 2023, "prompt lookup decoding"; vLLM's ``ngram``
  speculator): the token that followed the most recent earlier match of the longest suffix of up to
  3 tokens ending at ``x_{t+1}``; its agreement, and the share of positions where it is right and
  the drafter wrong.

Usage: python examples/copy_diagnosis.py DRAFTER OUT.json [MAX_NEW=128] [PROMPTS=data/heldout/general24.jsonl]
(about 2 min on 2 cores; ``data/heldout/copy12.jsonl`` asks the target to repeat 12 held-out texts,
where a drafter that copies agrees almost everywhere)
"""

import json
import sys

import torch

from slimspec_convert.checkpoint.load import load_drafter
from slimspec_convert.data.distill import read_prompts
from slimspec_convert.measure.chain_acceptance import build_onpolicy_eval, chain_agreement
from slimspec_convert.targets.fetch import get_smollm2
from slimspec_convert.targets.forward import resolve_aux_layers
from slimspec_convert.targets.load import load_target


def lookup(seq: list[int], t: int, max_ngram: int = 3) -> int | None:
    """Prompt lookup for ``x_{t+2}``: the token after the most recent earlier match of the longest
    suffix (up to ``max_ngram`` tokens) ending at ``x_{t+1}``; None when no suffix recurs."""
    for n in range(max_ngram, 0, -1):
        key = seq[t + 2 - n : t + 2]
        for j in range(t - 1, n - 3, -1):  # the match ends at j + 1 <= t, its next token j + 2 <= t + 1
            if seq[j + 2 - n : j + 2] == key:
                return seq[j + 2]
    return None


torch.set_num_threads(2)
drafter_path, out = sys.argv[1], sys.argv[2]
max_new = int(sys.argv[3]) if len(sys.argv) > 3 else 128
prompts_path = sys.argv[4] if len(sys.argv) > 4 else "data/heldout/general24.jsonl"
model, tok = load_target(get_smollm2(), "float32")
d, _ = load_drafter(drafter_path, target=model)
d = d.float().eval()
prompts = [r.messages[-1][1] for r in read_prompts([prompts_path])]
ev = build_onpolicy_eval(model, tok, prompts, resolve_aux_layers(d.config, model), max_new_tokens=max_new)
agree, starts = chain_agreement(d, ev, 1)  # agree [1, N]: first draft == x_{t+2}; starts [N, 2] (n, t)
probs, seqs = {}, {}
with torch.no_grad():
    for n in range(ev.input_ids.shape[0]):
        length = int(ev.answer_mask[n].nonzero().max()) + 1
        seqs[n] = ev.input_ids[n, :length].tolist()
        probs[n] = torch.softmax(model(ev.input_ids[n : n + 1, :length]).logits[0].float(), -1)
rows = []  # (drafter right, target p_max, copyable, lookup right)
for right, (n, t) in zip(agree[0].tolist(), starts.tolist(), strict=True):
    seq, want = seqs[n], seqs[n][t + 2]
    earlier = {(seq[i], seq[i + 1]) for i in range(t + 1)}  # bigrams ending at or before x_{t+1}
    rows.append((right, float(probs[n][t + 1].max()), (seq[t + 1], want) in earlier, lookup(seq, t) == want))


def share(xs) -> float:
    xs = list(xs)
    return round(sum(xs) / max(len(xs), 1), 4)


edges = [0.0, 0.3, 0.5, 0.7, 0.9, 1.01]
result = {
    "drafter": drafter_path,
    "prompts": prompts_path,
    "positions": len(rows),
    "agree": share(r[0] for r in rows),
    "by_target_confidence": [
        {
            "target_p_max": f"[{lo}, {min(hi, 1.0)})",
            "share_of_positions": share(lo <= r[1] < hi for r in rows),
            "agree": share(r[0] for r in rows if lo <= r[1] < hi),
        }
        for lo, hi in zip(edges, edges[1:], strict=False)
    ],
    "copyable": {
        "share_of_positions": share(r[2] for r in rows),
        "agree_copyable": share(r[0] for r in rows if r[2]),
        "agree_not_copyable": share(r[0] for r in rows if not r[2]),
    },
    "lookup": {
        "agree": share(r[3] for r in rows),
        "right_where_drafter_wrong": share(r[3] and not r[0] for r in rows),
        "either_right": share(r[0] or r[3] for r in rows),
    },
}
print(json.dumps(result, indent=1))
with open(out, "w") as f:
    json.dump(result, f, indent=1)
