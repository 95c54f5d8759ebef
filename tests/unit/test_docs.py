"""scripts/make_docs.py: the generated pages equal what the committed results JSON gives, byte for byte."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _make_docs():
    spec = importlib.util.spec_from_file_location("make_docs", ROOT / "scripts" / "make_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_pages_equal_their_regeneration(capsys):
    # The test of the docs: README headline, model card evaluation and docs/results.md come from results/.
    assert _make_docs().main(["--check"]) == 0, capsys.readouterr().out


def test_a_changed_figure_reaches_the_table():
    md = _make_docs()
    d = json.loads((ROOT / "results" / "smollm2" / "mainjob.json").read_text(encoding="utf-8"))
    full = next(r for r in d["rows"] if r["name"] == "full")
    before = md.e2e_table(d, compact=True)
    full["tokens_per_s"] = 12.345
    after = md.e2e_table(d, compact=True)
    changed = [line for line in after if line not in before]
    assert changed == [
        f"| full (49152 tokens) | {full['shape']} | {full['tau']:.3f} | 12.35 | "
        f"{full['speedup']:.2f}x | yes |"
    ]


def test_blocks_fill_only_between_their_markers():
    md = _make_docs()
    text = "keep\n<!-- BEGIN generated: x -->\nold\n<!-- END generated: x -->\nkeep too\n"
    assert md.fill_blocks(text, {"x": lambda: "new"}, Path("P.md")) == (
        "keep\n<!-- BEGIN generated: x -->\nnew\n<!-- END generated: x -->\nkeep too\n"
    )
    with pytest.raises(ValueError, match="P.md: no '<!-- BEGIN generated: y -->'"):
        md.fill_blocks(text, {"y": lambda: "new"}, Path("P.md"))
