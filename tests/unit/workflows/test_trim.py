"""Static vocabulary trimming: counts on a hand-counted corpus, a valid d2t, sliced head rows, round trip."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from slimspec_convert.checkpoint.load import load_native
from slimspec_convert.checkpoint.save import save_drafter
from slimspec_convert.cli.app import app
from slimspec_convert.model.vocab import draft_to_target_ids, validate_vocab_maps
from slimspec_convert.workflows.trim import count_calibration_tokens, trim_drafter
from tests.helpers.models import tiny_drafter, tiny_target
from tests.helpers.wordlevel import save_tiny_target_folder, word_tokenizer

WORDS = ["a", "b", "c", "d", "e", "f"]  # ids 6..11 (after the 6 specials of wordlevel.py)
A, B, C, D, E, F = range(6, 12)
IM_END = 2
V = 16

# Two chat records, one GSM8K record and one prompt-only string. Assistant tokens (incl. <|im_end|>):
#   "c c d" + "d c e" + "b c" -> c 4, d 2, b 1, e 1, <|im_end|> 3.  User text ("a b", "c a a", "e e e e")
#   is not counted; the prompt-only record "f f" counts all its tokens -> f 2.
CORPUS = [
    {"messages": [{"role": "user", "content": "a b"}, {"role": "assistant", "content": "c c d"}]},
    {"messages": [{"role": "user", "content": "c a a"}, {"role": "assistant", "content": "d c e"}]},
    {"question": "e e e e", "answer": "b c"},
    "f f",
]
HAND_COUNTS = {C: 4, IM_END: 3, D: 2, F: 2, B: 1, E: 1}


@pytest.fixture()
def corpus(tmp_path):
    path = tmp_path / "calib.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in CORPUS))
    return path


def test_counts_match_hand_count(corpus):
    calib = count_calibration_tokens([corpus], word_tokenizer(WORDS, V), V, max_length=64)
    expected = torch.zeros(V, dtype=torch.int64)
    for i, n in HAND_COUNTS.items():
        expected[i] = n
    assert torch.equal(calib.counts, expected)
    assert (calib.num_conversations, calib.num_prompt_only, calib.num_tokens) == (4, 1, 13)


def test_trim_keeps_most_frequent_and_slices_rows(corpus):
    calib = count_calibration_tokens([corpus], word_tokenizer(WORDS, V), V, max_length=64)
    src = tiny_drafter(vocab_size=V, draft_vocab_size=V)
    out = trim_drafter(src, calib.counts, 5)
    # Kept: c(4), <|im_end|>(3), d(2), f(2), then b over e by the lower id (both 1) -> {2, 7, 8, 9, 11}.
    kept = [IM_END, B, C, D, F]
    assert out.d2t.tolist() == [2, 6, 6, 6, 7]  # target_id - draft_id for ids sorted ascending
    assert draft_to_target_ids(out.d2t).tolist() == kept
    assert torch.nonzero(out.t2d).flatten().tolist() == kept
    validate_vocab_maps(out.d2t, out.t2d, 5, V)
    W_src, W_out = src.lm_head.weight, out.lm_head.weight
    for i in range(5):
        assert torch.equal(W_out[i], W_src[i + int(out.d2t[i])])
    assert not torch.equal(W_out, W_src[:5])  # a plain prefix slice would be wrong
    # Everything but the head is copied unchanged.
    assert torch.equal(out.fc.weight, src.fc.weight)
    assert torch.equal(out.embed_tokens.weight, src.embed_tokens.weight)


def test_trimmed_drafter_round_trips_through_loader(corpus, tmp_path):
    calib = count_calibration_tokens([corpus], word_tokenizer(WORDS, V), V, max_length=64)
    out = trim_drafter(tiny_drafter(vocab_size=V, draft_vocab_size=V), calib.counts, 5)
    save_drafter(out, tmp_path / "trimmed", include_embeddings=True)
    loaded = load_native(tmp_path / "trimmed")
    assert torch.equal(loaded.d2t, out.d2t) and torch.equal(loaded.t2d, out.t2d)
    h = torch.randn(1, 3, 32, generator=torch.Generator().manual_seed(1))
    assert torch.equal(loaded.logits(h), out.logits(h))
    assert loaded.to_target_ids(torch.tensor([0, 4])).tolist() == [IM_END, F]


def test_retrim_of_trimmed_and_lowrank_drafters():
    counts = torch.arange(128, dtype=torch.int64)  # id 127 most frequent
    # Source keeps every other id (0, 2, ..., 126): only covered ids may survive, so 126, 124, 122.
    src = tiny_drafter(vocab_size=128, draft_vocab_size=64)
    out = trim_drafter(src, counts, 3)
    assert draft_to_target_ids(out.d2t).tolist() == [122, 124, 126]
    assert torch.equal(out.lm_head.weight, src.lm_head.weight[[61, 62, 63]])  # source rows of 122, 124, 126
    low = tiny_drafter(vocab_size=128, draft_vocab_size=128, head_rank=4)
    out = trim_drafter(low, counts, 8)
    assert draft_to_target_ids(out.d2t).tolist() == list(range(120, 128))
    assert torch.equal(out.lm_head.up.weight, low.lm_head.up.weight[120:])
    assert torch.equal(out.lm_head.down.weight, low.lm_head.down.weight)
    with pytest.raises(ValueError, match="draft_vocab_size=65 outside"):
        trim_drafter(src, counts, 65)


def test_cli_trim(corpus, tmp_path):

    model = tiny_target(vocab_size=V)
    target = save_tiny_target_folder(tmp_path / "target", model, WORDS)
    src = tiny_drafter(vocab_size=V, draft_vocab_size=V)
    save_drafter(src, tmp_path / "src")  # without embeddings: borrowed from the target
    with torch.no_grad():
        src.embed_tokens.weight.copy_(model.get_input_embeddings().weight)
    runner = CliRunner()
    args = [
        "trim",
        str(tmp_path / "src"),
        str(tmp_path / "out"),
        "--draft-vocab-size",
        "4",
        "--data",
        str(corpus),
        "--target",
        str(target),
        "--json",
    ]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["coverage"] == pytest.approx(11 / 13)  # c 4 + <|im_end|> 3 + d 2 + f 2 of 13 tokens
    loaded = load_native(tmp_path / "out")
    assert draft_to_target_ids(loaded.d2t).tolist() == [IM_END, C, D, F]
    assert torch.equal(loaded.embed_tokens.weight, src.embed_tokens.weight)
    assert torch.equal(loaded.lm_head.weight, src.lm_head.weight[[IM_END, C, D, F]])
    res = runner.invoke(app, args)
    assert res.exit_code == 2 and "pass --force" in res.output
