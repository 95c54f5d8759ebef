"""Shared pieces of the decoding tests: the 16-token vocabulary, the head kinds, the two draft shapes,
MT-Bench prompts as tiny-vocabulary ids and the Hugging Face greedy reference."""

from __future__ import annotations

import torch

from slimspec_convert.decoding.config import DraftConfig
from slimspec_convert.decoding.prompts import load_prompts
from tests.helpers.models import DATA

MT_BENCH = DATA / "eval" / "mt_bench" / "question.jsonl"
V = 16  # small vocabulary: a random drafter's top-k often holds the target's argmax
EOS = 2
HEADS = {
    "dense": dict(vocab_size=V, draft_vocab_size=V),
    "trimmed": dict(vocab_size=V, draft_vocab_size=8),  # d2t keeps the even target ids
    "lowrank": dict(vocab_size=V, draft_vocab_size=V, head_rank=4),
    "two-layers": dict(vocab_size=V, draft_vocab_size=V, num_hidden_layers=2),  # extra_layers.0
}
CHAIN = DraftConfig(method="chain", depth=4)
TREE = DraftConfig(method="tree", depth=4, top_k=3, total_tokens=10)


def mt_bench_ids(n: int, vocab: int, lengths=(5, 11, 3, 8, 14, 6)) -> list[list[int]]:
    """First turns of MT-Bench as byte ids folded into [3, vocab) (0 pad, 1 bos, 2 eos)."""
    texts = [t[0] for t in load_prompts(MT_BENCH)][:n]
    return [
        [3 + b % (vocab - 3) for b in t.encode()[: lengths[i % len(lengths)]]] for i, t in enumerate(texts)
    ]


def hf_greedy(model, ids: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(
        torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=EOS, pad_token_id=0
    )
    return out[0, len(ids) :].tolist()
