"""Replacing a folder (``atomic.staged_folder``): OUT holds the complete old or the complete new folder
whenever a process is killed, and the next run repairs or reports what an interrupted one left.

Kills are real: a child process runs the replace and calls ``os._exit`` at the chosen moment (no
cleanup handler runs), then the parent inspects the folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from slimspec_convert.atomic import recover_folder, staged_folder
from slimspec_convert.checkpoint.load import inspect_drafter
from slimspec_convert.cli import app
from tests.helpers.eagle3_layouts import write_layout
from tests.helpers.models import REPO, tiny_drafter

CHILD = textwrap.dedent(
    """
    import importlib.util, os, shutil, sys
    from pathlib import Path

    # atomic.py alone (stdlib only): importing the package would load torch and transformers
    spec = importlib.util.spec_from_file_location("atomic", sys.argv[1])
    atomic = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(atomic)
    out, point, mode, content = Path(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5:]
    real_replace, real_exchange = os.replace, atomic._exchange

    def replace(a, b):
        real_replace(a, b)
        if point == "between-renames" and ".old-" in Path(b).name or point == "after-renames" and b == out:
            os._exit(137)

    def exchange(a, b):
        if mode == "fallback":
            return False
        done = real_exchange(a, b)
        if point == "after-exchange":
            os._exit(137)
        return done

    atomic.os.replace, atomic._exchange = replace, exchange
    with atomic.staged_folder(out, force=True) as tmp:
        if content:
            shutil.copytree(content[0], tmp, dirs_exist_ok=True)
        else:
            for name in ("config.json", "model.safetensors"):
                (tmp / name).write_text("new")
        if point == "while-building":
            os._exit(137)
    """
)


def run_child(out: Path, point: str, mode: str, *content: Path) -> int:
    cmd = [sys.executable, "-c", CHILD, str(REPO / "slimspec_convert" / "atomic.py"), str(out), point, mode]
    return subprocess.run([*cmd, *map(str, content)], capture_output=True, timeout=120).returncode


def make_old(out: Path) -> None:
    out.mkdir()
    for name in ("config.json", "model.safetensors"):
        (out / name).write_text("old")


def contents(out: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(out.iterdir())}


def leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


OLD = {"config.json": "old", "model.safetensors": "old"}
NEW = {"config.json": "new", "model.safetensors": "new"}


@pytest.mark.parametrize(
    "mode, point, at_kill, after_recovery, found",
    [
        ("exchange", "while-building", OLD, OLD, "a build folder of an interrupted run"),
        ("exchange", "after-exchange", NEW, NEW, "a build folder of an interrupted run"),
        ("fallback", "while-building", OLD, OLD, "a build folder of an interrupted run"),
        ("fallback", "between-renames", None, OLD, "restored it from .out.old-"),
        ("fallback", "after-renames", NEW, NEW, "left by an interrupted replace (OUT is complete)"),
    ],
)
def test_a_kill_at_any_moment_leaves_a_complete_folder(tmp_path, mode, point, at_kill, after_recovery, found):
    out = tmp_path / "out"
    make_old(out)
    assert run_child(out, point, mode) == 137
    assert ".out.lock" in leftovers(out)  # the killed writer's lock file: no process holds it any more
    if at_kill is None:  # the two-rename fallback's one window: OUT is back at the next run
        assert not out.exists() and leftovers(out)[1].startswith(".out.old-")
    else:
        assert contents(out) == at_kill
    lines = recover_folder(out)
    assert any(found in line for line in lines), lines
    assert contents(out) == after_recovery and leftovers(out) == []
    assert recover_folder(out) == []  # nothing left to find


def test_an_error_between_the_two_renames_puts_the_old_folder_back_at_once(tmp_path, monkeypatch):
    import slimspec_convert.atomic as atomic

    out = tmp_path / "out"
    make_old(out)
    real, calls = os.replace, []

    def replace(a, b):
        calls.append(b)
        if len(calls) == 2:
            raise KeyboardInterrupt  # Ctrl-C between the renames
        real(a, b)

    monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    monkeypatch.setattr(atomic.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt), staged_folder(out, force=True) as tmp:
        (tmp / "config.json").write_text("new")
    monkeypatch.undo()
    assert contents(out) == OLD and leftovers(out) == []


def test_leftovers_of_a_live_process_are_left_alone(tmp_path):
    out = tmp_path / "out"
    make_old(out)
    parent = os.getppid()  # alive, and not this process
    (tmp_path / f".out.old-{parent}").mkdir()
    lines = recover_folder(out)
    assert lines == [f"{out}: left .out.old-{parent} alone: the process replacing OUT still runs"]
    assert (tmp_path / f".out.old-{parent}").is_dir() and contents(out) == OLD


def test_convert_force_killed_between_renames_then_rerun(tmp_path):
    """The state a ``convert --force`` killed between the renames leaves (made by the same staged_folder
    call, building a real converted folder), then the next ``slimspec convert`` runs."""
    src = write_layout(tiny_drafter(draft_vocab_size=64), "specforge", tmp_path / "src")
    out, new = tmp_path / "out", tmp_path / "new"
    runner = CliRunner()
    assert runner.invoke(app, ["convert", str(src), str(out), "--rank", "4"]).exit_code == 0
    assert runner.invoke(app, ["convert", str(src), str(new), "--rank", "8"]).exit_code == 0
    assert run_child(out, "between-renames", "fallback", new) == 137 and not out.exists()
    again = runner.invoke(app, ["convert", str(src), str(out), "--rank", "8"])  # no --force: nothing lost
    assert again.exit_code == 2 and again.output.startswith(
        f"error: {out}: already exists (was missing after an interrupted replace; restored it from .out.old-"
    )
    assert json.loads((out / "config.json").read_text())["lm_head_rank"] == 4  # the complete old folder
    assert inspect_drafter(out).config.head_rank == 4 and leftovers(out) == []  # and it reads back whole
    assert runner.invoke(app, ["convert", str(src), str(out), "--rank", "8", "--force"]).exit_code == 0
    assert json.loads((out / "config.json").read_text())["lm_head_rank"] == 8 and leftovers(out) == []
