"""scripts/make_docs.py: the generated pages equal what the committed results JSON gives, byte for byte."""

import json
from pathlib import Path

import pytest

from tests.helpers.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]


def _make_docs():
    return load_script("scripts/make_docs.py")


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


def test_the_kind_table_names_a_hand_set_lookup_and_the_provenance_cites_the_job():
    md = _make_docs()
    row = dict(kind="full", draft_vocab_size=49152, lossless=True)
    rows = [
        dict(name="none", kind="plain", tau=1.0, tokens_per_s=30.0, speedup=1.0, lossless=None),
        dict(row, name="full", shape="chain-1+lookup-2", tau=1.5, tokens_per_s=33.0, speedup=1.1),
        dict(row, name="full-lookup3", shape="chain-1+lookup-3", tau=1.6, tokens_per_s=31.5, speedup=1.05),
    ]
    d = {"rows": rows, "num_prompts": 10, "config": {"drafter_lookup": [["full-lookup3", 3]]}}
    assert md.kind_table([("math", d)])[2:] == [
        "| math | 10 | full (49152 tokens) | chain-1+lookup-2 | 1.500 | 33.00 | 1.10x | yes |",
        "| math | 10 | full (49152 tokens), `--lookup 3` by hand | chain-1+lookup-3 | 1.600 | 31.50 "
        "| 1.05x | yes |",
    ]
    d["provenance"] = {"command": "slimspec bench e2e --target T", "job": "bash examples/quickstart.sh x"}
    assert md.provenance_lines(d)[2] == (
        "- Command: `bash examples/quickstart.sh x` (its benchmark step: `slimspec bench e2e --target T`)."
    )
