"""The one atomic write: every file and folder the package produces goes through here.

Files are written to a temporary sibling and renamed into place (``os.replace``), so a reader sees
the old file or the new one, never half of one. Folders (a converted drafter, a cached target) are
built in a temporary sibling folder and swapped in at the end; replacing an existing folder uses
``renameat2(RENAME_EXCHANGE)`` where the kernel has it, so OUT holds the complete old or the
complete new folder at every instant, and otherwise a two-rename swap that a later run repairs
(:func:`recover_folder`). Permissions follow the umask, as ``cp`` and ``save_pretrained`` do
(``mkstemp``/``mkdtemp`` alone would give 0600/0700).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import glob
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _honour_umask(path: Path, directory: bool) -> None:
    os.chmod(path, (0o777 if directory else 0o666) & ~_umask())


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success rename it to ``path``, on error delete it.

    Args:
        path: the final file; its folder is created if missing.

    Yields:
        The temporary file's path (exists, empty, mode 0666 & ~umask).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        _honour_umask(Path(tmp), directory=False)
        yield Path(tmp)
        _honour_umask(Path(tmp), directory=False)  # again: a writer may have recreated it (safetensors: 0600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temp file in the same folder, then rename."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_json(path: Path, obj: Any) -> None:
    """``obj`` as JSON (indent 2, newline-terminated), written atomically."""
    atomic_write_bytes(path, (json.dumps(obj, indent=2) + "\n").encode())


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths atomically (Linux ``renameat2``); False where unsupported."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    return rc == 0


def _backups(out: Path) -> list[Path]:
    return sorted(out.parent.glob(f".{glob.escape(out.name)}.old-*"), key=lambda p: p.stat().st_mtime)


def _pid_of(leftover: Path, kind: str) -> int | None:
    """The pid in ``.OUT.old-<pid>`` or ``.OUT.tmp-<pid>-<random>`` (None if unreadable)."""
    tail = leftover.name.rsplit(f".{kind}-", 1)[-1]
    pid = tail.split("-", 1)[0]
    return int(pid) if pid.isdigit() else None


def _orphaned(leftover: Path, kind: str) -> bool:
    """True when the process that made ``leftover`` no longer runs (a live one may still need it)."""
    pid = _pid_of(leftover, kind)
    return pid is not None and pid != os.getpid() and not _alive(pid)


def recover_folder(out: Path) -> list[str]:
    """Repair what an interrupted :func:`staged_folder` can leave behind, and say what was found.

    Only leftovers of processes that no longer run are touched. If OUT is missing and a
    ``.OUT.old-<pid>`` backup exists (a kill between the two renames of the fallback swap), the
    newest backup is renamed back to OUT, so OUT again holds the complete old folder. Backups beside
    an existing OUT and ``.OUT.tmp-<pid>-*`` build folders are deleted. Leftovers of a process
    that still runs are reported and left alone.

    Returns:
        One line per finding (also logged as warnings).
    """
    out = Path(out)
    if not out.parent.is_dir():
        return []
    done = []
    backups = []
    for b in _backups(out):
        if _orphaned(b, "old"):
            backups.append(b)
        else:
            done.append(f"{out}: left {b.name} alone: the process replacing OUT still runs")
    if backups and not out.exists():
        os.replace(backups[-1], out)
        done.append(f"{out}: was missing after an interrupted replace; restored it from {backups[-1].name}")
        backups = backups[:-1]
    for b in backups:
        shutil.rmtree(b, ignore_errors=True)
        done.append(f"{out}: removed {b.name}, left by an interrupted replace (OUT is complete)")
    for tmp in out.parent.glob(f".{glob.escape(out.name)}.tmp-*"):
        if _orphaned(tmp, "tmp"):
            shutil.rmtree(tmp, ignore_errors=True)
            done.append(f"{out}: removed {tmp.name}, a build folder of an interrupted run")
    for line in done:
        logger.warning(line)
    return done


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def check_folder_free(out: Path, force: bool) -> list[str]:
    """Repair leftovers of an interrupted replace (:func:`recover_folder`), then refuse an existing OUT.

    Returns:
        What :func:`recover_folder` found and did, one line each.

    Raises:
        FileExistsError: ``out`` exists and ``force`` is off (the message includes what was found).
    """
    found = recover_folder(out)
    if out.exists() and not force:
        what = "; ".join(line.removeprefix(f"{out}: ") for line in found)
        raise FileExistsError(
            f"{out}: already exists{f' ({what})' if what else ''}; pass --force (force=True) to replace it"
        )
    return found


def _swap_in(tmp: Path, out: Path) -> None:
    """Replace the existing ``out`` by ``tmp``; OUT holds a complete folder at every instant it exists.

    ``renameat2(RENAME_EXCHANGE)`` swaps both names in one step. Without it, OUT is renamed to a
    backup and ``tmp`` into its place: an exception between the two renames puts the backup back
    at once; a kill leaves only the backup, which :func:`recover_folder` restores at the next run.
    """
    if _exchange(tmp, out):  # OUT now holds the new folder, tmp the old one
        shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()
        return
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    moved = False
    try:
        os.replace(out, old)
        moved = True
        os.replace(tmp, out)
    except BaseException:
        if moved and not out.exists():
            os.replace(old, out)
        raise
    shutil.rmtree(old) if old.is_dir() else old.unlink()


@contextlib.contextmanager
def staged_folder(out: Path, force: bool = False) -> Iterator[Path]:
    """Build a folder beside ``out`` and put it in place only when complete.

    Args:
        out: the final folder.
        force: replace an existing ``out`` (else :class:`FileExistsError`, checked before and after).

    Yields:
        The build folder (``.OUT.tmp-<pid>-<random>``, mode 0777 & ~umask); before it is put in
        place, every file in it gets 0666 & ~umask and every folder 0777 & ~umask.

    Raises:
        FileExistsError: ``out`` exists and ``force`` is off.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    check_folder_free(out, force)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-{os.getpid()}-"))
    try:
        _honour_umask(tmp, directory=True)
        yield tmp
        for p in tmp.rglob("*"):  # writers inside may not honour it (safetensors' save_file: 0600)
            _honour_umask(p, directory=p.is_dir())
        if not out.exists():
            os.replace(tmp, out)
            return
        if not force:
            raise FileExistsError(f"{out}: appeared while it was being built; pass --force to replace it")
        _swap_in(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
