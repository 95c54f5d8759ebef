"""Repository hygiene that a restructure must not break again: every module and test file that code,
docs and scripts name exists, and the licence pyproject declares ships as a LICENSE file.

Checked in every tracked ``.py``, ``.md``, ``.sh`` and ``.toml`` file except ``docs/CHANGELOG.md`` (its
history names what was removed):

* paths under ``slimspec_convert/``, ``finetune/``, ``tests/``, ``scripts/`` and ``examples/`` (e.g.
  ``slimspec_convert/decoding/hf_generate.py``) exist, relative to the repository root;
* dotted names of the two packages (e.g. ``slimspec_convert.measure.draft_shape.plan_draft_shape`` in
  a docstring) resolve: the longest module prefix exists, and at most two names follow it, the first
  defined (or imported) in that module.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[2]
SKIP = {"docs/CHANGELOG.md", "tests/unit/test_repository.py"}  # the history; this file's own bad examples
PATH_RE = re.compile(
    r"(?<![\w/.-])((?:slimspec_convert|finetune|tests|scripts|examples)/[\w/.-]*\.(?:py|sh))\b"
)
DOTTED_RE = re.compile(r"(?<![\w./-])((?:slimspec_convert|finetune)(?:\.[A-Za-z_]\w*)+)")
# Names that a test builds on purpose in a temporary folder (tests/unit/test_layers.py's fake modules).
FAKE = {"slimspec_convert.lowrank.a", "slimspec_convert.lowrank.b"}
FAKE_PATHS = {"slimspec_convert/lowrank/a.py", "slimspec_convert/lowrank/b.py"}
FILE_SUFFIXES = {
    "json",
    "jsonl",
    "md",
    "py",
    "sh",
    "txt",
    "png",
    "gz",
    "safetensors",
}  # a file name, not a module


def tracked_text_files() -> list[str]:
    """Tracked ``.py``/``.md``/``.sh``/``.toml`` files (git ls-files), minus :data:`SKIP`."""
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [f for f in out.split() if f.endswith((".py", ".md", ".sh", ".toml")) and f not in SKIP]


def module_file(parts: list[str]) -> Path | None:
    """The source of module ``parts`` (``a/b.py`` or ``a/b/__init__.py``), or None."""
    base = REPO.joinpath(*parts)
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def dotted_problem(name: str) -> str | None:
    """Why a dotted name does not resolve (None when it does)."""
    parts = name.split(".")
    k = len(parts)
    while k and module_file(parts[:k]) is None:
        k -= 1
    rest = parts[k:]
    if not k or len(rest) > 2:
        return "no such module"
    if rest:
        text = module_file(parts[:k]).read_text(encoding="utf-8")
        n = rest[0]
        defined = rf"^\s*(?:async\s+def|def|class)\s+{n}\b|^{n}\b\s*[:=]|\bimport\b.*\b{n}\b|^\s+{n}\b"
        if not re.search(defined, text, re.MULTILINE):
            return f"{'.'.join(parts[:k])} defines no {rest[0]}"
    return None


def test_every_named_module_and_test_file_exists():
    missing = []
    for rel in tracked_text_files():
        text = (REPO / rel).read_text(encoding="utf-8", errors="replace")
        for m in PATH_RE.finditer(text):
            if m.group(1) not in FAKE_PATHS and not (REPO / m.group(1)).exists():
                missing.append(f"{rel}: {m.group(1)} does not exist")
        for m in DOTTED_RE.finditer(text):
            name = m.group(1).rstrip(".")
            if name.rsplit(".", 1)[-1] in FILE_SUFFIXES or "__" in name:  # a file name, a dunder (__file__)
                continue
            if name not in FAKE and (why := dotted_problem(name)) is not None:
                missing.append(f"{rel}: {name}: {why}")
    assert not missing, "\n".join(sorted(set(missing)))


def test_the_checks_catch_a_removed_module():
    # Guard: the resolver says no to names the restructure removed (the flat layout's modules).
    assert dotted_problem("slimspec_convert.drafter.Eagle3Drafter") == "slimspec_convert defines no drafter"
    assert dotted_problem("slimspec_convert.model.drafter.Eagle3Drafter") is None
    assert dotted_problem("slimspec_convert.model.drafter.NoSuchThing") == (
        "slimspec_convert.model.drafter defines no NoSuchThing"
    )
    assert PATH_RE.findall("see tests/test_factorize.py and `slimspec_convert/target/load.py`.") == [
        "tests/test_factorize.py",
        "slimspec_convert/target/load.py",
    ]


@pytest.mark.parametrize("field", ["license"])
def test_the_declared_licence_ships_as_a_license_file(field):
    declared = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"][field]
    assert declared == {"text": "Apache-2.0"}
    text = (REPO / "LICENSE").read_text(encoding="utf-8")
    assert text.lstrip().startswith("Apache License\n                           Version 2.0, January 2004")
    assert "END OF TERMS AND CONDITIONS" in text and len(text.splitlines()) == 201  # the full text
