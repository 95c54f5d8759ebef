"""Fault injection (issue 53): the real commands (``slimspec convert``, ``trim``, ``finetune``,
``generate`` in subprocesses, tiny random models) against a read-only folder, a file-size limit,
a symbolic link as OUT, SIGKILL and SIGTERM inside a save, and two processes writing one OUT.

Each test pins the exit code, the one ``error:`` line (no traceback) and the exact listing of the
folder OUT lives in. docs/faults.md lists the same cases for users.

Read-only folders: as a normal user ``chmod a-w`` (EACCES); as root, where chmod stops nothing, a
read-only bind mount in a private mount namespace (``unshare -m``, EROFS); where neither is possible
(root without mount namespaces) those tests skip and say why.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from slimspec_convert.workflows.convert import ConvertConfig
from slimspec_convert.workflows.convert import convert as convert_checkpoint
from tests.helpers.eagle3_layouts import save_tiny_target, write_layout
from tests.helpers.models import DATA, tiny_drafter, tiny_target, tiny_tokenizer

pytestmark = pytest.mark.faults

CLI = [sys.executable, "-c", "from slimspec_convert.cli import main; main()"]
RO_MOUNT = 'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" "$1" && shift && exec "$@"'
FSIZE = 16 * 1024  # below every weights file written here, above the lock file
FINETUNE = ["--steps", "1", "--max-length", "32", "--batch-size", "2", "--data-source", "human"]
FINETUNE += ["--eval-every", "1", "--save-every", "1", "--ttt-steps", "1", "--measure-prompts", "0"]
EFBIG = "file too large (a file-size limit, see `ulimit -f`, or the file system's own) (EFBIG)"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """A tiny target folder (V=128, d=32, with tokenizer), a SpecForge-layout drafter, training data."""
    root = tmp_path_factory.mktemp("models")
    target = tiny_target()
    folder = save_tiny_target(target, root / "target")
    tiny_tokenizer().save_pretrained(folder)
    drafter = tiny_drafter(aux_layer_ids=None)
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
    data = root / "data.jsonl"
    data.write_text("".join((DATA / "train" / "gsm8k" / "train.jsonl").read_text().splitlines(True)[:12]))
    src = write_layout(drafter, "specforge", root / "drafter")
    convert_checkpoint(src, root / "rank4", ConvertConfig(rank=4))  # in-process: the "old OUT" of a test
    return {"target": folder, "drafter": src, "data": data, "rank4": root / "rank4"}


def old_out(models, out: Path) -> dict[str, bytes]:
    """A copy of a rank-4 conversion at ``out`` (what an earlier run left); its bytes."""
    shutil.copytree(models["rank4"], out)
    return snapshot(out)


def env(tmp_path: Path, fault: str | None = None) -> dict[str, str]:
    e = {**os.environ, "OMP_NUM_THREADS": "1", "SLIMSPEC_CACHE": str(tmp_path / "cache")}
    e.pop("SLIMSPEC_FAULT", None)
    return e | ({"SLIMSPEC_FAULT": fault} if fault else {})


def start(args, tmp_path, *, fault=None, fsize=None, prefix=()) -> subprocess.Popen:
    """Start the real CLI; ``fsize`` sets RLIMIT_FSIZE in the child (``ulimit -f``)."""

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    return subprocess.Popen(
        [*prefix, *CLI, *map(str, args)],
        env=env(tmp_path, fault),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=limit if fsize else None,
    )


def finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run(args, tmp_path, **kw) -> subprocess.CompletedProcess:
    return finish(start(args, tmp_path, **kw))


def error_line(res: subprocess.CompletedProcess, code: int = 2) -> str:
    """Exit ``code``, no traceback, exactly one ``error:`` line and it is the last line of stderr."""
    assert res.returncode == code, (res.returncode, res.stderr[-3000:])
    assert "Traceback" not in res.stderr, res.stderr
    lines = res.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and res.stderr.count("error:") == 1, res.stderr
    return lines[-1]


def listing(folder: Path) -> list[str]:
    return sorted(os.listdir(folder))


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def convert(models, out, *extra) -> list:
    return ["convert", models["drafter"], out, "--rank", "4", *extra]


def trim(models, out, *extra) -> list:
    return ["trim", models["drafter"], out, "--draft-vocab-size", "64", "--data", models["data"]] + [
        "--target",
        models["target"],
        *extra,
    ]


def finetune(models, out, *extra) -> list:
    return [
        "finetune",
        "--target",
        models["target"],
        "--drafter",
        models["drafter"],
        "--data",
        models["data"],
    ] + [
        "--out",
        out,
        *FINETUNE,
        *extra,
    ]


COMMANDS = {"convert": convert, "trim": trim, "finetune": finetune}


# ---- read-only folders ------------------------------------------------------------------------
def _can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount --make-rprivate / 2>/dev/null; true"])
    return probe.returncode == 0


def read_only(folder: Path):
    """(argv prefix, message meaning) that make ``folder`` read-only for the child; skip if impossible."""
    if os.geteuid() != 0:
        for p in [folder, *folder.rglob("*")]:
            p.chmod(p.stat().st_mode & ~0o222)
        return (), "permission denied (EACCES)"
    if _can_unshare():
        return ("unshare", "-m", "sh", "-c", RO_MOUNT, "sh", str(folder)), "read-only file system (EROFS)"
    pytest.skip("running as root without mount namespaces (unshare -m): chmod does not stop root's writes")


def writable_again(folder: Path) -> None:
    for p in [folder, *folder.rglob("*")]:
        p.chmod(p.stat().st_mode | 0o200)


def test_read_only_out_parent(models, tmp_path):
    """convert, trim and finetune (run at once) into a read-only folder: one line each, nothing made."""
    parent = tmp_path / "ro"
    parent.mkdir()
    prefix, meaning = read_only(parent)
    jobs = {
        name: start(make(models, parent / name), tmp_path, prefix=prefix) for name, make in COMMANDS.items()
    }
    res = {name: finish(job) for name, job in jobs.items()}
    writable_again(parent)
    advice = (
        "write to a folder on a writable file system"
        if "EROFS" in meaning
        else "make it writable for this user (chmod) or choose another path"
    )
    for name, r in res.items():
        assert error_line(r) == f"error: {parent / name}: {meaning}; {advice}"
    assert listing(parent) == []


def test_read_only_out_parent_with_force_keeps_the_old_out(models, tmp_path):
    parent = tmp_path / "ro"
    parent.mkdir()
    old = old_out(models, parent / "out")
    prefix, meaning = read_only(parent)
    res = run(convert(models, parent / "out", "--rank", "8", "--force"), tmp_path, prefix=prefix)
    writable_again(parent)
    assert meaning in error_line(res) and listing(parent) == ["out"] and snapshot(parent / "out") == old


def test_read_only_target_folder_is_only_read(models, tmp_path):
    """convert --target (calibrated) and finetune never write into the target's folder."""
    target = tmp_path / "target"
    shutil.copytree(models["target"], target)
    before = snapshot(target)
    prefix, _ = read_only(target)
    ro = {**models, "target": target}
    jobs = [
        start(["convert", ro["drafter"], tmp_path / "c", "--rank", "4", "--target", target]
              + ["--calibration-data", ro["data"], "--calibration-samples", "4"], tmp_path, prefix=prefix),
        start(finetune(ro, tmp_path / "f"), tmp_path, prefix=prefix),
    ]  # fmt: skip
    results = [finish(j) for j in jobs]
    writable_again(target)
    for res in results:
        assert res.returncode == 0, res.stderr[-3000:]
    assert snapshot(target) == before and listing(tmp_path) == ["c", "f", "target"]


# ---- a file-size limit (ulimit -f) ------------------------------------------------------------------
def test_file_size_limit_every_command(models, tmp_path):
    """All three at once under a 16 KiB limit: exit 2, EFBIG naming the path, nothing left behind."""
    for name in ("c", "t", "f"):
        (tmp_path / name).mkdir()
    old = old_out(models, tmp_path / "c" / "out")
    jobs = {
        "c": start(convert(models, tmp_path / "c" / "out", "--rank", "8", "--force"), tmp_path, fsize=FSIZE),
        "t": start(trim(models, tmp_path / "t" / "out"), tmp_path, fsize=FSIZE),
        "f": start(finetune(models, tmp_path / "f" / "out"), tmp_path, fsize=FSIZE),
    }  # fmt: skip
    res = {k: finish(p) for k, p in jobs.items()}
    assert error_line(res["c"]).startswith(f"error: {tmp_path / 'c' / 'out'}: {EFBIG}; raise the limit")
    assert error_line(res["t"]).startswith(f"error: {tmp_path / 't' / 'out'}: {EFBIG}; raise the limit")
    line = error_line(res["f"])
    assert re.match(rf"error: {re.escape(str(tmp_path / 'f' / 'out'))}/[\w.]+: {re.escape(EFBIG)}", line), (
        line
    )
    assert listing(tmp_path / "c") == ["out"] and snapshot(tmp_path / "c" / "out") == old  # untouched
    assert listing(tmp_path / "t") == [] and listing(tmp_path / "f") == []  # no empty OUT


# ---- links and files where folders go ----------------------------------------------------------
def test_force_onto_a_symlinked_out_is_refused(models, tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (real / "keep.txt").write_text("the linked folder's own file")
    (tmp_path / "out").symlink_to(real)
    jobs = [start(convert(models, tmp_path / "out", "--force"), tmp_path)]
    jobs.append(start(trim(models, tmp_path / "out", "--force"), tmp_path))
    for res in map(finish, jobs):
        assert error_line(res) == (
            f"error: {tmp_path / 'out'}: is a symbolic link to {real}; slimspec does not write through a "
            f"link (--force included): give the real folder ({real}) or remove the link"
        )
    assert listing(tmp_path) == ["out", "real"] and (tmp_path / "out").is_symlink()
    assert snapshot(real) == {"keep.txt": b"the linked folder's own file"}


def test_a_file_where_a_folder_is_expected(models, tmp_path):
    (tmp_path / "file").write_text("keep me")
    jobs = [
        start(convert(models, tmp_path / "file" / "out"), tmp_path),
        start(convert(models, tmp_path / "file", "--force"), tmp_path),
    ]
    a, b = map(finish, jobs)
    assert error_line(a) == (
        f"error: {tmp_path / 'file'}: is a file where a folder is expected (a parent of "
        f"{tmp_path / 'file' / 'out'}); choose another OUT"
    )
    assert (
        error_line(b)
        == f"error: {tmp_path / 'file'}: is a file, not a folder; remove it or choose another OUT"
    )
    assert listing(tmp_path) == ["file"] and (tmp_path / "file").read_text() == "keep me"


# ---- SIGKILL and SIGTERM inside a save -------------------------------------------------------------
def _rank(out: Path) -> int:
    return json.loads((out / "config.json").read_text())["lm_head_rank"]


KILL_POINTS = ("lock", "file", "built", "swapped")


def test_sigkill_inside_a_save_then_the_next_run_cleans_up(models, tmp_path):
    """convert --force killed at each point of a save (four runs at once, one folder each): OUT holds
    the complete old (or, once swapped, the complete new) folder; the next run cleans up and says so."""
    outs = {point: tmp_path / point / "out" for point in KILL_POINTS}
    old = {point: old_out(models, out) for point, out in outs.items()}  # rank 4
    procs = {
        point: start(convert(models, out, "--rank", "8", "--force"), tmp_path, fault=f"kill:{point}")
        for point, out in outs.items()
    }
    for proc in procs.values():
        assert finish(proc).returncode == -signal.SIGKILL
    left = {}
    for point, out in outs.items():
        work, pid = out.parent, procs[point].pid
        left[point] = [n for n in listing(work) if n.startswith(f".out.tmp-{pid}-")]
        assert len(left[point]) == (0 if point == "lock" else 1), (point, listing(work))
        assert listing(work) == sorted([".out.lock", "out", *left[point]]), point
        if point == "swapped":  # the new folder is in place; the build name holds the old one
            assert _rank(out) == 8 and snapshot(work / left[point][0]) == old[point]
        else:
            assert snapshot(out) == old[point], point
    again = {
        point: start(convert(models, out, "--rank", "8", "--force"), tmp_path) for point, out in outs.items()
    }
    for point, proc in again.items():
        res, out, pid = finish(proc), outs[point], procs[point].pid
        assert res.returncode == 0, res.stderr
        found = [f"{out}: took over .out.lock left by process {pid}, which no longer runs"]
        found += [f"{out}: removed {n}, a build folder of an interrupted run" for n in left[point]]
        assert [x for x in res.stderr.splitlines() if "interrupted run" in x or "took over" in x] == found
        assert listing(out.parent) == ["out"] and _rank(out) == 8


def test_sigterm_inside_a_save_leaves_the_old_out(models, tmp_path):
    work = tmp_path / "w"
    work.mkdir()
    out = work / "out"
    old = old_out(models, out)
    proc = start(convert(models, out, "--rank", "8", "--force"), tmp_path, fault="stop:built")
    _wait_stopped(proc)
    proc.send_signal(signal.SIGTERM)  # pending while stopped; runs as soon as it continues
    proc.send_signal(signal.SIGCONT)
    line = error_line(finish(proc))
    assert line == (
        "error: interrupted (SIGTERM); temporary files were removed and an existing OUT was left as it was"
    )
    assert listing(work) == ["out"] and snapshot(out) == old


# ---- two processes, one OUT ---------------------------------------------------------------------
def _wait_stopped(proc: subprocess.Popen, timeout_s: float = 120) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        state = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state == "T":
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError("the child never reached its fault point")


def test_a_second_process_into_a_busy_out_stops_at_once(models, tmp_path):
    work = tmp_path / "w"
    work.mkdir()
    out = work / "out"
    first = start(convert(models, out), tmp_path, fault="stop:lock")  # holds OUT's lock, then stops
    _wait_stopped(first)
    second = run(convert(models, out, "--rank", "8"), tmp_path)
    assert error_line(second) == (
        f"error: {out}: another slimspec process (pid {first.pid}) is writing it now; wait for it to "
        "finish or choose another OUT"
    )
    assert listing(work) == [".out.lock"]
    first.send_signal(signal.SIGCONT)
    assert finish(first).returncode == 0
    assert listing(work) == ["out"] and _rank(out) == 4


def test_two_processes_started_together_one_wins_cleanly(models, tmp_path):
    work = tmp_path / "w"
    work.mkdir()
    out = work / "out"
    procs = {
        4: start(convert(models, out), tmp_path),
        8: start(convert(models, out, "--rank", "8"), tmp_path),
    }
    res = {rank: finish(p) for rank, p in procs.items()}
    winners = [rank for rank, r in res.items() if r.returncode == 0]
    assert len(winners) == 1, {k: (r.returncode, r.stderr[-500:]) for k, r in res.items()}
    loser = res[12 - winners[0]]
    line = error_line(loser)
    assert line.startswith(f"error: {out}: already exists; pass --force") or "is writing it now" in line, line
    assert listing(work) == ["out"] and _rank(out) == winners[0]
    assert listing(out) == ["config.json", "model.safetensors", "slimspec_report.json"]


# ---- messages that used to mislead ------------------------------------------------------------------
def test_a_target_one_token_off_names_the_field(models, tmp_path):
    target = save_tiny_target(tiny_target(vocab_size=129), tmp_path / "t129")
    tiny_tokenizer().save_pretrained(target)
    res = run(["generate", "--target", target, "--drafter", models["drafter"], "--prompt", "a b"], tmp_path)
    assert error_line(res) == (
        "error: target LlamaForCausalLM: its 'embed_tokens.weight' table has shape [129, 32], the drafter "
        "needs [128, 32]: vocab_size differs: the target's config.json vocab_size=129, the drafter's "
        "config.json vocab_size=128; is --target the target this drafter was trained for?"
    )


def test_a_prompts_file_that_is_not_utf8_names_file_and_line(models, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_bytes(b'{"prompt": "hello"}\n\n{"prompt": "caf\xe9"}\n')
    args = ["generate", "--target", models["target"], "--drafter", models["drafter"], "--prompts", prompts]
    assert error_line(run(args, tmp_path)) == (
        f"error: {prompts}:3: not UTF-8 text (byte 0xe9 at column 16); save the file as UTF-8, e.g. "
        "`iconv -f latin1 -t utf-8 IN > OUT`"
    )


def test_eos_sources_that_disagree_get_a_notice(models, tmp_path):
    target = tmp_path / "target"
    shutil.copytree(models["target"], target)
    cfg = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**cfg, "eos_token_id": [2, 5]}))
    args = ["generate", "--target", target, "--drafter", "none", "--prompt", "a b", "--max-new-tokens", "2"]
    res = run(args, tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert (
        "notice: EOS ids differ (generation_config.json [2], config.json [2, 5], the tokenizer [2]): "
        "slimspec stops at any of [2, 5]; transformers' generate() stops at generation_config.json's [2] "
        "only, so its outputs may run longer (docs/faults.md)"
    ) in res.stderr.splitlines()
