"""Training tokens/s of ``train-drafter``'s step on the real target: 6 steps after one warm-up.

The step: 4 sequences of up to 512 tokens of the committed distilled data, 7 TTT steps, the drafter's
body trained and its head (the target's embedding) frozen; SmolLM2-135M-Instruct target, the demo
drafter, float32, 2 threads. Run it on two checkouts to compare them ("before" and "after"):

    git worktree add /tmp/before 79c1d70
    python examples/train_speed.py /tmp/before
    python examples/train_speed.py .                                    # bf16 head products (AMX CPUs)
    python examples/train_speed.py . '{"feature_cache": "/tmp/fc"}'     # + cached target features
    python examples/train_speed.py . '{"bf16_autocast": false}'         # float32 head products

Prints one JSON line: tokens, seconds, tokens/s and the six step losses.
"""

import json
import sys
import time
from pathlib import Path

code = sys.argv[1] if len(sys.argv) > 1 else "."
sys.path.insert(0, str(Path(code).resolve()))

import torch  # noqa: E402

from finetune.config import FinetuneConfig  # noqa: E402
from finetune.train.trainer import Trainer  # noqa: E402
from slimspec_convert.checkpoint.load import load_drafter  # noqa: E402
from slimspec_convert.data.examples import load_examples  # noqa: E402
from slimspec_convert.targets.fetch import get_smollm2  # noqa: E402
from slimspec_convert.targets.forward import resolve_aux_layers  # noqa: E402
from slimspec_convert.targets.load import load_target  # noqa: E402

torch.set_num_threads(2)
here = Path(__file__).resolve().parents[1]
model, tok = load_target(get_smollm2(), "float32")
drafter, _ = load_drafter(here / "drafters" / "smollm2-135m-eagle3", target=model)
drafter = drafter.float()
data = here / "data" / "train" / "distilled" / "smollm2-135m-instruct.jsonl"
examples, _ = load_examples(tok, [data], 512)
kw = dict(train="body", batch_size=4, ttt_steps=7, max_length=512, data_source="human")
if len(sys.argv) > 2:
    kw.update(json.loads(sys.argv[2]))
cfg = FinetuneConfig.for_new_drafter(**kw)
aux = resolve_aux_layers(drafter.config, model)
trainer = Trainer(drafter, model, aux, examples, examples[:8], cfg, "/tmp/train_speed", tok.pad_token_id)
if hasattr(trainer, "prepare_features"):
    trainer.prepare_features()  # untimed: built once, reused by every later run
trainer.train_step()  # warm-up
tokens, losses, t0 = 0, [], time.perf_counter()
for _ in range(6):
    loss, n = trainer.train_step()
    tokens += n
    losses.append(round(loss, 4))
dt = time.perf_counter() - t0
print(
    json.dumps(
        {
            "code": code,
            "config": kw,
            "tokens": tokens,
            "seconds": round(dt, 2),
            "tokens_per_s": round(tokens / dt, 1),
            "losses": losses,
        }
    )
)
