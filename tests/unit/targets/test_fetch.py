"""``slimspec fetch``'s pieces that need no network: the GGUF assembled by a package's ``assemble()``
is checked against the hash pinned here, and names that are neither demo targets nor hub ids are refused."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import pytest

from slimspec_convert.targets import fetch
from slimspec_convert.targets.fetch import PIP_TARGETS, fetch_target, gguf_from_site, target_licence

GGUF_BYTES = b"GGUF tiny stand-in"


def fake_site(tmp_path):
    """A site folder holding a package whose ``assemble(path)`` writes GGUF_BYTES (two chunks)."""
    pkg = tmp_path / "site" / "fake_gguf_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "def assemble(path):\n"
        "    with open(path, 'wb') as f:\n"
        f"        f.write({GGUF_BYTES[:5]!r}); f.write({GGUF_BYTES[5:]!r})\n"
        "    return path\n"
    )
    return tmp_path / "site"


def spec_for(sha256: str):
    return dataclasses.replace(PIP_TARGETS["gemma3-270m"], package="fake_gguf_pkg", gguf_sha256=sha256)


def test_assembled_gguf_with_the_pinned_hash_is_returned(tmp_path):
    site = fake_site(tmp_path)
    gguf = gguf_from_site(spec_for(hashlib.sha256(GGUF_BYTES).hexdigest()), site, tmp_path)
    assert gguf.name == "gemma-3-270m-q4_k_m.gguf" and gguf.read_bytes() == GGUF_BYTES


def test_assembled_gguf_with_another_hash_is_refused(tmp_path):
    site = fake_site(tmp_path)
    with pytest.raises(ValueError, match="differs from the pinned 0000"):
        gguf_from_site(spec_for("0000"), site, tmp_path)


def test_unknown_name_is_refused_naming_the_choices(tmp_path):
    with pytest.raises(ValueError, match=r"'gemma3': .*\['gemma3-270m', 'smollm2'\] or a hub id"):
        fetch_target("gemma3", tmp_path)


def test_the_gemma_licence_is_named():
    assert "Gemma Terms of Use" in target_licence("gemma3-270m")
    assert PIP_TARGETS["gemma3-270m"].licence_files == ("GEMMA_TERMS.html", "NOTICE.md")
    assert target_licence("someone/model") is None


def test_a_script_target_argument_is_a_demo_name_or_a_path(monkeypatch, tmp_path):
    fetched = []
    monkeypatch.setattr(fetch, "get_pip_target", lambda name: fetched.append(name) or tmp_path / name)
    assert fetch.demo_or_path("gemma3-270m") == tmp_path / "gemma3-270m" and fetched == ["gemma3-270m"]
    assert fetch.demo_or_path("runs/my-target") == Path("runs/my-target") and len(fetched) == 1
