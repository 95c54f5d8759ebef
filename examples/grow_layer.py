"""Grow a drafter by one decoder layer that starts as the identity (``add_decoder_layer``,
``finetune/train/init.py``).

The grown folder drafts exactly as the source does until it is fine-tuned (``slimspec finetune
--train body`` trains the new layer with the rest of the body); head and embeddings stay the
target's, borrowed at load time.

    python examples/grow_layer.py DRAFTER OUT [SEED=0]     # seconds
"""

import sys
from pathlib import Path

from finetune.train.init import add_decoder_layer
from slimspec_convert.checkpoint.load import load_drafter
from slimspec_convert.checkpoint.save import save_drafter
from slimspec_convert.targets.fetch import get_smollm2
from slimspec_convert.targets.load import load_target

src, dst = sys.argv[1], Path(sys.argv[2])
seed = int(sys.argv[3]) if len(sys.argv) > 3 else 0
if dst.exists():
    sys.exit(f"error: {dst}: exists; remove it first")
model, _ = load_target(get_smollm2(), "float32")
drafter, _ = load_drafter(src, target=model)
grown = add_decoder_layer(drafter.float(), seed=seed)
save_drafter(grown, dst, include_head=False)
print(f"{dst}: {grown.config.num_hidden_layers} decoder layers (the new one the identity), seed {seed}")
