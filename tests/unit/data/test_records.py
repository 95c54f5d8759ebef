"""slimspec_convert/data/records.py and examples.py: formats, assistant-only masks, bad data, batches."""

import json

import pytest
import torch

from slimspec_convert.data.examples import batch_indices, build_examples, collate, drawn_indices
from slimspec_convert.data.records import DataError, DataStats, read_conversations, record_to_conversations
from tests.helpers.models import DATA, tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def test_every_shipped_training_file_parses():
    stats = DataStats()
    generated = {"distilled", "gemma3"}  # targets' answers, made here
    files = sorted(p for p in (DATA / "train").rglob("*.json*") if not generated & set(p.parts))
    convs = read_conversations(files, stats)
    assert len(files) == 10
    # 7473 GSM8K + 4535 + 1923 GPTeacher + 626 OASST paths + 250 prompts + 252 + instances of 175 seed tasks
    # + 1800 + 624 writing-steered user turns the target wrote (self_prompts/, prompts only)
    # + 1200 copy-heavy prompts (copy_prompts/)
    assert stats.records == 7473 + 4535 + 1923 + 100 + 250 + 252 + 175 + 1800 + 624 + 1200
    assert sum(1 for c in convs if c[-1]["role"] == "assistant") > 14000


def test_formats_normalise_to_messages():
    assert record_to_conversations({"question": "q", "answer": "a"}, "x:1") == [
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    ]
    sg = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}
    assert record_to_conversations(sg, "x:1")[0][1] == {"role": "assistant", "content": "yo"}
    tree = {
        "prompt": {
            "role": "prompter",
            "text": "p",
            "replies": [
                {"role": "assistant", "text": "a1", "replies": []},
                {"role": "assistant", "text": "a2", "replies": []},
            ],
        }
    }
    assert [c[-1]["content"] for c in record_to_conversations(tree, "x:1")] == ["a1", "a2"]
    with pytest.raises(DataError, match="x:3: unknown record format"):
        record_to_conversations({"foo": 1}, "x:3")


def test_assistant_mask_covers_only_the_answer(tok):
    conv = [
        {"role": "user", "content": "How many apples are there?"},
        {"role": "assistant", "content": "There are 5 apples."},
    ]
    (ex,) = build_examples(tok, [conv], 100)
    toks = tok.convert_ids_to_tokens(ex.input_ids[ex.loss_mask].tolist())
    assert toks == ["There", "are", "5", "<unk>", ".", "<|im_end|>"]


def test_max_answer_tokens_keeps_each_answers_first_tokens_and_adds_no_end(tok):
    conv = [
        {"role": "user", "content": "How many apples are there?"},
        {"role": "assistant", "content": "There are 5 apples."},
        {"role": "user", "content": "And pears?"},
        {"role": "assistant", "content": "There are 3 pears."},
    ]
    (full,) = build_examples(tok, [conv], 100)
    stats = DataStats()
    (cut,) = build_examples(tok, [conv], 100, stats, max_answer_tokens=2)
    toks = tok.convert_ids_to_tokens(cut.input_ids[cut.loss_mask].tolist())
    assert toks == ["There", "are", "There", "are"]  # two per turn, no "<|im_end|>" where none was
    n = cut.input_ids.numel()
    assert bool(cut.loss_mask[-1])  # the sequence ends at its last supervised token
    assert torch.equal(cut.input_ids, full.input_ids[:n])  # the same tokens, not a re-encoding
    assert (stats.kept, stats.truncated, stats.supervised_tokens) == (1, 0, 4)
    (same,) = build_examples(tok, [conv], 100, max_answer_tokens=100)
    assert torch.equal(same.input_ids, full.input_ids) and torch.equal(same.loss_mask, full.loss_mask)


def test_bad_data_errors_name_file_and_line(tmp_path, tok):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match="empty.jsonl: file is empty"):
        read_conversations([empty])
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "a", "answer": "b"}) + "\n{not json\n")
    with pytest.raises(DataError, match="bad.jsonl:2: malformed JSON line"):
        read_conversations([bad])


def test_gzip_files_read_as_their_plain_text(tmp_path):
    import gzip

    distilled = DATA / "train" / "distilled" / "smollm2-135m-instruct.jsonl"
    gz = tmp_path / "distilled.jsonl.gz"
    gz.write_bytes(gzip.compress(distilled.read_bytes()))
    assert read_conversations([gz]) == read_conversations([distilled])
    arr = tmp_path / "a.json.gz"
    arr.write_bytes(gzip.compress(json.dumps([{"question": "q", "answer": "a"}]).encode()))
    qa = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert read_conversations([arr]) == [qa]
    broken = tmp_path / "broken.jsonl.gz"
    broken.write_bytes(gzip.compress(distilled.read_bytes())[:100])
    with pytest.raises(DataError, match="broken.jsonl.gz: not a readable gzip file"):
        read_conversations([broken])
    bad = tmp_path / "bad.jsonl.gz"
    bad.write_bytes(gzip.compress(b"{not json\n"))
    with pytest.raises(DataError, match="bad.jsonl.gz:1: malformed JSON line"):
        read_conversations([bad])


def test_no_assistant_and_too_long_are_counted(tok):
    stats = DataStats()
    convs = [
        [{"role": "user", "content": "only a prompt"}],
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a " * 50}],
    ]
    examples = build_examples(tok, convs, 20, stats)
    assert (stats.skipped_no_assistant, stats.truncated, stats.kept) == (1, 1, 1)
    assert examples[0].input_ids.numel() == 20


def test_batches_are_deterministic_and_cover_an_epoch():
    first = [batch_indices(10, 3, s, seed=1) for s in range(3)]
    assert first == [batch_indices(10, 3, s, seed=1) for s in range(3)]
    assert len(set(sum(first, []))) == 9  # one epoch of 3 batches, no repeats


@pytest.mark.parametrize(
    "n, bs, batches", [(10, 3, 2), (10, 3, 3), (10, 3, 5), (10, 3, 40), (2, 4, 3), (12, 4, 3)]
)
def test_drawn_indices_are_the_union_of_the_batches(n, bs, batches):
    """--feature-cache builds only these: within an epoch, across epochs, fewer examples than a batch."""
    want = sorted({i for s in range(batches) for i in batch_indices(n, bs, s, seed=7)})
    assert drawn_indices(n, bs, batches, seed=7) == want


def test_collate_right_pads(tok):
    conv = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    a, b = build_examples(tok, [conv, conv + conv[-1:]], 100)
    batch = collate([a, b], pad_id=0)
    n = a.input_ids.numel()
    assert batch["attention_mask"][0].tolist() == [1] * n + [0] * (batch["input_ids"].shape[1] - n)
    assert not batch["loss_mask"][0, n:].any()
    assert torch.equal(batch["input_ids"][0, :n], a.input_ids)


def test_completion_records_are_raw_text_with_the_completion_supervised():
    from slimspec_convert.data.examples import encode_conversation
    from tests.helpers.wordlevel import word_tokenizer

    tok = word_tokenizer(["a", "b", "c", "d"], 16)  # ids: a 6, b 7, c 8, d 9; chat template present
    (conv,) = record_to_conversations({"prefix": "a b", "completion": "c c d"}, "x:1")
    assert conv == [{"role": "prefix", "content": "a b"}, {"role": "completion", "content": "c c d"}]
    ids, mask, truncated = encode_conversation(tok, conv, 64)  # raw even though a template exists
    assert ids.tolist() == [6, 7, 8, 8, 9] and mask.tolist() == [False, False, True, True, True]
    ids, mask, _ = encode_conversation(tok, conv, 64, max_answer_tokens=2)
    assert ids.tolist() == [6, 7, 8, 8] and mask.tolist() == [False, False, True, True]
    # a conversation without the chat template (--no-chat / a base model): turns joined by a blank line
    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b d"}]
    ids, mask, _ = encode_conversation(tok, chat, 64, chat=False)
    assert ids.tolist() == [6, 7, 9] and mask.tolist() == [False, True, True]
    ids, _, _ = encode_conversation(tok, chat, 64)  # the template: <|im_start|> user a <|im_end|> ...
    assert ids.tolist()[:4] == [1, 3, 6, 2]
    with pytest.raises(DataError, match="'completion' must be a string"):
        record_to_conversations({"prefix": "a", "completion": 3}, "x:1")
