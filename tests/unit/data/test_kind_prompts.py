"""data/eval/kinds: examples/make_kind_prompts.py rebuilds the committed files byte for byte, and every
prompt counts as an evaluation prompt (distill and the fine-tune refuse it, naming its upstream)."""

import json
from pathlib import Path

from slimspec_convert.data.distill import eval_prompt_index, normalise
from tests.helpers.scripts import load_script

ROOT = Path(__file__).resolve().parents[3]


def _module():
    return load_script("examples/make_kind_prompts.py")


def test_the_committed_kind_prompts_are_what_the_script_builds():
    built = _module().kinds()
    assert sorted(built) == ["code", "math", "qa", "summarisation", "translation", "writing"]
    for kind, rows in built.items():
        want = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        assert (ROOT / "data" / "eval" / "kinds" / f"{kind}.jsonl").read_text(encoding="utf-8") == want, kind
    assert built["translation"][0]["prompt"] == (
        "Translate into French: A new program had 60 downloads in the first month."
    )  # GSM8K test line 11's first sentence
    assert built["qa"][0]["line"] == 61 and built["writing"][0]["line"] == 1  # MT-Bench stem starts at 61


def test_every_kind_prompt_is_an_evaluation_prompt_named_by_its_upstream():
    index = eval_prompt_index()
    for kind, rows in _module().kinds().items():
        for r in rows:
            where = index[normalise(r["prompt"])]  # the upstream benchmark, never the derived file
            assert where.startswith("data/eval/") and "kinds" not in where, (kind, r["line"], where)
            if kind != "code":  # HumanEval's prompts are also EAGLE's, listed first
                assert where == r["source"], (kind, r["line"])
