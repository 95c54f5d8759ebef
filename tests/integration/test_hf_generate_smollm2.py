"""Issue 15 on the real SmolLM2-135M-Instruct target: ``model.generate(..., custom_generate=
speculative_generate, drafter=...)`` with the demo drafter converted to a rank-72 head (plain SVD)
equals plain ``model.generate`` token for token, single and left-padded batch of 2, with and without
``return_dict_in_generate``; a TextIteratorStreamer yields the same text; ``num_beams=2`` is refused."""

from __future__ import annotations

import pytest
import torch
from transformers import TextIteratorStreamer

from slimspec_convert import ConvertConfig, DraftConfig, convert, load_drafter, speculative_generate
from slimspec_convert.targets.load import load_target
from tests.helpers.models import REPO

DRAFTER = REPO / "drafters" / "smollm2-135m-eagle3"
QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that returns the square of a number.",
    "Natalia sold 48 clips in April and half as many in May. How many clips did she sell in total?",
]
NEW = 24


@pytest.fixture(scope="module")
def setup(smollm2_path, tmp_path_factory):
    model, tok = load_target(smollm2_path, "float32")
    tok.padding_side = "left"
    out = tmp_path_factory.mktemp("hf_generate") / "r72"
    # plain SVD (no calibration pass); the target lends the head the demo drafter does not store
    convert(DRAFTER, out, ConvertConfig(rank=72, target=str(smollm2_path), calibrate=False))
    drafter, _ = load_drafter(out, model)  # the loaded target lends its embedding
    drafter = drafter.to(model.dtype).eval()
    assert drafter.config.head_rank == 72
    texts = [
        tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in QUESTIONS
    ]
    return model, tok, drafter, texts


@pytest.mark.integration
def test_smollm2_generate_with_drafter_equals_plain(setup):
    model, tok, drafter, texts = setup
    greedy = dict(max_new_tokens=NEW, do_sample=False)
    spec = dict(custom_generate=speculative_generate, drafter=drafter, draft=DraftConfig("tree", 4, 4, 12))
    for text in texts:
        inputs = tok(text, return_tensors="pt", add_special_tokens=False)
        want = model.generate(**inputs, **greedy)
        got = model.generate(**inputs, **greedy, **spec)
        assert torch.equal(got, want), text
    batch = tok(texts[1:], return_tensors="pt", padding=True, add_special_tokens=False)
    assert bool((batch["attention_mask"] == 0).any())  # guard: really left-padded
    want = model.generate(**batch, **greedy, return_dict_in_generate=True)
    got = model.generate(**batch, **greedy, **spec, return_dict_in_generate=True)
    assert torch.equal(got.sequences, want.sequences)
    assert len(tok.decode(got.sequences[1, batch["input_ids"].shape[1] :]).split()) >= 10
    # A streamer sees exactly the returned text (single row, return_dict_in_generate).
    inputs = tok(texts[0], return_tensors="pt", add_special_tokens=False)
    streamer = TextIteratorStreamer(tok, skip_prompt=True, skip_special_tokens=True)
    got = model.generate(**inputs, **greedy, **spec, streamer=streamer, return_dict_in_generate=True)
    new = got.sequences[0, inputs["input_ids"].shape[1] :]
    assert "".join(streamer) == tok.decode(new, skip_special_tokens=True)
    assert torch.equal(got.sequences, model.generate(**inputs, **greedy))
    with pytest.raises(ValueError, match="num_beams=2"):
        model.generate(**inputs, max_new_tokens=4, num_beams=2, **spec)
