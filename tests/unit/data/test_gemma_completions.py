"""examples/gemma_completions.py: the committed held-out prompt files are what the script writes, and the
stdlib ``pyfunc`` prefixes are whole signatures with docstrings, split by hash, and no evaluation prompt."""

import ast
import sys
from pathlib import Path

import pytest

from slimspec_convert.data.distill import eval_prompt_index, normalise
from tests.helpers.scripts import load_script

ROOT = Path(__file__).resolve().parents[3]


def _module():
    return load_script("examples/gemma_completions.py")


def test_the_four_kind_heldout_file_is_unchanged_by_the_pyfunc_kind(tmp_path):
    out = tmp_path / "heldout.jsonl"
    _module().write_heldout(out, 12, 0)
    assert out.read_bytes() == (ROOT / "data" / "heldout" / "gemma3-completions.jsonl").read_bytes()


@pytest.mark.skipif(
    sys.version_info[:2] != (3, 11), reason="the committed pyfunc prompts come from Python 3.11's stdlib"
)
def test_the_pyfunc_heldout_file_is_what_the_script_writes(tmp_path):
    out = tmp_path / "pyfunc.jsonl"
    _module().write_heldout(out, 24, 0, ("pyfunc",))
    assert out.read_bytes() == (ROOT / "data" / "heldout" / "gemma3-pyfunc.jsonl").read_bytes()


def test_pyfunc_prefixes_are_signatures_with_docstrings_split_by_hash_and_not_evaluation_prompts():
    m = _module()
    train = m.plan("train", 0, ("pyfunc",))
    heldout = m.plan("heldout", 0, ("pyfunc",))
    assert len(train) > 1000 and len(heldout) > 24
    assert {(x["source"], x["index"]) for x in train}.isdisjoint((x["source"], x["index"]) for x in heldout)
    assert all(m._split(x["source"], x["index"]) == "heldout" for x in heldout)
    index = eval_prompt_index()
    for x in train + heldout:
        p = x["prefix"]
        assert p.startswith(("def ", "async def ")) and p.endswith(('"\n', "'\n")), p[-40:]
        fn = ast.parse(p + "    pass\n").body[0]  # a whole signature and a docstring, nothing more
        assert isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) and len(fn.body) == 2
        assert ast.get_docstring(fn) is not None
        assert normalise(p) not in index, x["source"]
