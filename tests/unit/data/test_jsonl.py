"""data.records.jsonl_lines: JSON Lines split at "\\n" only, so raw U+2028 and kin inside strings survive."""

import json

from slimspec_convert.data.records import jsonl_lines, read_conversations
from slimspec_convert.decoding.prompts import load_prompts

# Characters str.splitlines() breaks at that JSON allows raw inside a string.
ODD = "a\u2028b\u2029c\x85d\x0be\x0cf\x1cg\x1dh\x1ei"


def test_lines_split_at_newline_only_with_file_line_numbers():
    recs = [{"text": ODD}, {"text": "plain"}]
    text = json.dumps(recs[0], ensure_ascii=False) + "\r\n\n  \n" + json.dumps(recs[1], ensure_ascii=False)
    got = list(jsonl_lines(text))
    assert [n for n, _ in got] == [1, 4]
    assert [json.loads(line) for _, line in got] == recs
    one = json.dumps(recs[0], ensure_ascii=False)
    assert one.splitlines() != [one]  # what the readers did before


def test_training_and_prompt_files_written_without_ascii_escapes_read_back_exactly(tmp_path):
    conv = [{"role": "user", "content": "say " + ODD}, {"role": "assistant", "content": ODD + " said"}]
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"messages": conv}, ensure_ascii=False) + "\n", encoding="utf-8")
    assert read_conversations([data]) == [conv]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"prompt": ODD}, ensure_ascii=False) + "\n" + json.dumps({"prompt": "two"}) + "\n",
        encoding="utf-8",
    )
    assert load_prompts(prompts) == [(ODD,), ("two",)]
