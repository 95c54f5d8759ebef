"""The one atomic write: every file and folder the package produces goes through here.

Files are written to a temporary sibling and renamed into place (``os.replace``), so a reader sees
the old file or the new one, never half of one. Folders (a converted drafter, a cached target) are
built in a temporary sibling folder and swapped in at the end; replacing an existing folder uses
``renameat2(RENAME_EXCHANGE)`` where the kernel has it, so OUT holds the complete old or the
complete new folder at every instant, and otherwise a two-rename swap that a later run repairs
(:func:`recover_folder`). Permissions follow the umask, as ``cp`` and ``save_pretrained`` do
(``mkstemp``/``mkdtemp`` alone would give 0600/0700).

Faults (docs/faults.md): a write that fails inside a build folder or a temp file is re-raised as an
``OSError`` naming the final path (not the hidden temp name), after the temp entries are removed;
folders this module created for the write (OUT's missing parents) are removed again. One process at a
time builds a given OUT: ``.OUT.lock`` (``flock``) is held from the first check to the swap, so a
second process converting into the same OUT stops at once with :class:`FolderBusyError`. An OUT that
is a symbolic link, or a file, is refused (:class:`NotAFolderError`) even with ``force``: replacing
through a link would silently move another folder's contents.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import glob
import json
import logging
import os
import re
import resource
import shutil
import signal
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

logger = logging.getLogger(__name__)

_RENAME_EXCHANGE = 2  # linux/fs.h

# Fault injection for tests/faults (docs/faults.md): SLIMSPEC_FAULT=<action>:<point> makes this process
# SIGKILL or SIGSTOP itself at that point of a write, so the real command can be killed, or held
# while a second one runs, at an exact moment. Points: lock (OUT's lock taken), built (the build
# folder is complete, not yet in place), swapped (the new folder is in place, the old one not yet
# deleted), file (a temp file is written, not yet renamed).
FAULT_ENV = "SLIMSPEC_FAULT"
FAULT_POINTS = ("lock", "built", "swapped", "file")
_AT_FDCWD = -100


class FolderBusyError(FileExistsError):
    """Another live process holds OUT's lock (``.OUT.lock``): it is writing the same OUT now."""


class NotAFolderError(FileExistsError):
    """OUT, or one of its parents, exists but is a symbolic link or a file where a folder is expected."""


def write_error(err: BaseException, path: Path, temps: tuple[Path, ...] = ()) -> BaseException:
    """``err`` re-aimed at ``path`` when it concerns a temp entry of the write or names no path at all.

    A failing ``write()`` raises ``OSError`` without a file name (EFBIG, ENOSPC), and safetensors
    raises its own ``SafetensorError`` whose text carries the OS error code (``Os { code: 27, ...``);
    the user should see the final path they asked for, not the hidden temp name.

    Args:
        err: what the write raised.
        path: the final file or folder.
        temps: the temp file or build folder the write went to.

    Returns:
        An ``OSError(errno, strerror, path)`` (chained by the caller), or ``err`` itself when it names
        another path (e.g. a source file read during the build) or is no I/O error.
    """
    code = None
    if isinstance(err, OSError):
        name = os.fsdecode(err.filename) if err.filename is not None else None
        if name is not None and not any(name == str(t) or name.startswith(f"{t}{os.sep}") for t in temps):
            return err
        code = err.errno
    elif type(err).__name__ == "SafetensorError":  # safetensors' Rust I/O errors
        m = re.search(r"(?:code: |os error )(\d+)", str(err))
        code = int(m.group(1)) if m else None
        if code is None:
            return err
    else:
        return err
    if code is None:
        return err
    return OSError(code, os.strerror(code), str(path))


def _raise_write_error(err: BaseException, path: Path, temps: tuple[Path, ...] = ()) -> NoReturn:
    """Re-raise ``err`` (inside its ``except``), as :func:`write_error` re-aims it when it does."""
    mapped = write_error(err, path, temps)
    if mapped is err:
        raise err
    raise mapped from err


def _limit_hit(written: list[Path]) -> int | None:
    """EFBIG or ENOSPC when a failed write's files hit the file-size limit or filled the disk, else None.

    Some writers report a short write in their own words (torch.save: ``RuntimeError: [enforce fail
    at inline_container.cc] unexpected pos ...``); the files they left say what happened.
    """
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    for f in written:
        with contextlib.suppress(OSError):
            if soft != resource.RLIM_INFINITY and f.is_file() and f.stat().st_size >= soft:
                return errno.EFBIG
            if os.statvfs(f.parent).f_bavail == 0:
                return errno.ENOSPC
    return None


def _raise_failed_write(err: BaseException, path: Path, temps: tuple[Path, ...]) -> NoReturn:
    """:func:`_raise_write_error`; a writer's own short-write error as EFBIG/ENOSPC (:func:`_limit_hit`)."""
    if not isinstance(err, (OSError, KeyboardInterrupt)) and type(err).__name__ != "SafetensorError":
        files = [f for t in temps for f in ([t] if t.is_file() else t.rglob("*") if t.is_dir() else [])]
        if (code := _limit_hit(files)) is not None:
            raise OSError(code, os.strerror(code), str(path)) from err
    _raise_write_error(err, path, temps)


def check_folder_path(out: Path) -> None:
    """Refuse an OUT that is a symbolic link or a file, or whose parents hold a file where a folder goes.

    Raises:
        NotAFolderError: naming the link and its target, or the file.
    """
    out = Path(out)
    if out.is_symlink():
        target = os.readlink(out)
        state = "" if out.exists() else ", which does not exist"
        raise NotAFolderError(
            f"{out}: is a symbolic link to {target}{state}; slimspec does not write through a link "
            f"(--force included): give the real folder ({os.path.realpath(out)}) or remove the link"
        )
    if out.exists() and not out.is_dir():
        raise NotAFolderError(f"{out}: is a file, not a folder; remove it or choose another OUT")
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise NotAFolderError(
                    f"{parent}: is a file where a folder is expected (a parent of {out}); choose another OUT"
                )
            break


def _make_parents(folder: Path) -> list[Path]:
    """``mkdir -p folder``; the folders it created, outermost first (to remove them after a failure)."""
    missing = [p for p in (folder, *folder.parents) if not p.exists()][::-1]
    folder.mkdir(parents=True, exist_ok=True)
    return missing


def _remove_empty(folders: list[Path]) -> None:
    for f in reversed(folders):
        with contextlib.suppress(OSError):
            f.rmdir()


_FAULTS_FIRED: set[str] = set()


def _fault(point: str) -> None:
    """SIGKILL / SIGSTOP this process the first time it reaches ``point``, when ``$SLIMSPEC_FAULT`` asks."""
    action, _, at = os.environ.get(FAULT_ENV, "").partition(":")
    if at == point and action in ("kill", "stop") and point not in _FAULTS_FIRED:
        _FAULTS_FIRED.add(point)
        os.kill(os.getpid(), signal.SIGKILL if action == "kill" else signal.SIGSTOP)


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

    Raises:
        OSError: the write failed; one about the temp file or without a file name names ``path``
            (errno kept), after the temp file and the folders this call created are removed.
    """
    path = Path(path)
    made = _make_parents(path.parent)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except BaseException as err:  # the folder refuses the temp file (read-only, no permission, full)
        _remove_empty(made)
        _raise_write_error(err, path, (path.parent,))
    os.close(fd)
    try:
        _honour_umask(Path(tmp), directory=False)
        yield Path(tmp)
        _honour_umask(Path(tmp), directory=False)  # again: a writer may have recreated it (safetensors: 0600)
        _fault("file")
        os.replace(tmp, path)
    except BaseException as err:
        try:
            _raise_failed_write(err, path, (Path(tmp),))
        finally:
            Path(tmp).unlink(missing_ok=True)
            _remove_empty(made)


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
    if (pid := _remove_stale_lock(out)) is not None:
        done.append(f"{out}: removed {lock_path(out).name}, left by process {pid}, which no longer runs")
    for line in done:
        logger.warning(line)
    return done


def _remove_stale_lock(out: Path) -> str | None:
    """Remove ``.OUT.lock`` when no process holds it (its writer was killed); the pid it named, else None.

    A lock held by this process through another descriptor, or by any live process, is left alone
    (``flock`` refuses a second descriptor too).
    """
    path = lock_path(out)
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    pid = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    os.close(fd)
    return pid


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def claim_folder(out: Path, force: bool) -> Iterator[list[str]]:
    """Before the work, check OUT as :func:`staged_folder` will at the end, then hold its lock until
    the block ends (a whole command's run), so a long run fails in its first second: a link or file
    as OUT, a folder nobody may write into, another process writing OUT, an existing OUT without
    ``force``. A :func:`staged_folder` inside the block reuses the lock.

    Yields:
        What :func:`recover_folder` found and did, one line each.

    Raises:
        FileExistsError, NotAFolderError, FolderBusyError, OSError: as :func:`staged_folder`.
    """
    out = Path(out)
    check_folder_path(out)
    made = _make_parents(out.parent)
    try:
        with folder_lock(out):
            yield _check_free(out, force)
    except BaseException as err:
        _remove_empty(made)
        _raise_write_error(err, out, (lock_path(out),))


def _check_free(out: Path, force: bool) -> list[str]:
    """Repair leftovers of an interrupted replace (:func:`recover_folder`), then refuse an existing OUT.

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


_HELD: dict[str, int] = {}  # lock files this process holds -> nesting depth


def lock_path(out: Path) -> Path:
    """The lock file of OUT: ``.OUT.lock`` beside it."""
    return out.parent / f".{out.name}.lock"


@contextlib.contextmanager
def folder_lock(out: Path) -> Iterator[None]:
    """Hold OUT's lock (``flock`` on ``.OUT.lock``, holding this process's pid) or fail at once.

    The lock file is removed on release. A lock file left by a killed process holds no lock (the
    kernel drops ``flock`` locks with their process), so the next run takes it over. Re-entrant
    within a process: a command holds it over its whole run (``convert``: from the first check,
    through the calibration, to the swap) and :func:`staged_folder` inside takes it again for free.

    Raises:
        FolderBusyError: another live process holds it (its pid in the message).
        OSError: the lock file cannot be created (read-only or full file system, no permission).
    """
    path = lock_path(out)
    key = os.path.abspath(path)
    if key in _HELD:
        _HELD[key] += 1
        try:
            yield
        finally:
            _HELD[key] -= 1
        return
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666 & ~_umask())
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise FolderBusyError(
                f"{out}: another slimspec process (pid {holder}) is writing it now; wait for it to finish "
                "or choose another OUT"
            ) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:  # else the holder removed the file between our open and flock: take the new one
            break
        os.close(fd)
    left = os.pread(fd, 32, 0).decode(errors="replace").strip()
    if left and left != str(os.getpid()):
        logger.warning("%s: took over %s left by process %s, which no longer runs", out, path.name, left)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        _fault("lock")
        _HELD[key] = 1
        yield
    finally:
        _HELD.pop(key, None)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.close(fd)


def _swap_in(tmp: Path, out: Path) -> None:
    """Replace the existing ``out`` by ``tmp``; OUT holds a complete folder at every instant it exists.

    ``renameat2(RENAME_EXCHANGE)`` swaps both names in one step. Without it, OUT is renamed to a
    backup and ``tmp`` into its place: an exception between the two renames puts the backup back
    at once; a kill leaves only the backup, which :func:`recover_folder` restores at the next run.
    """
    if _exchange(tmp, out):  # OUT now holds the new folder, tmp the old one
        _fault("swapped")
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
    _fault("swapped")
    shutil.rmtree(old) if old.is_dir() else old.unlink()


@contextlib.contextmanager
def staged_folder(out: Path, force: bool = False) -> Iterator[Path]:
    """Build a folder beside ``out`` and put it in place only when complete.

    OUT's lock is held throughout (:func:`folder_lock`). On any failure (an exception, Ctrl-C, a
    SIGTERM turned into an exception by the CLI) the build folder, the lock file and the parents
    this call created are removed, and OUT is as it was.

    Args:
        out: the final folder.
        force: replace an existing ``out`` (else :class:`FileExistsError`, checked before and after).

    Yields:
        The build folder (``.OUT.tmp-<pid>-<random>``, mode 0777 & ~umask); before it is put in
        place, every file in it gets 0666 & ~umask and every folder 0777 & ~umask.

    Raises:
        FileExistsError: ``out`` exists and ``force`` is off.
        NotAFolderError: ``out`` is a symbolic link or a file (also with ``force``).
        FolderBusyError: another process is building the same ``out``.
        OSError: the write failed (naming ``out``; errno kept: EACCES, EROFS, ENOSPC, EFBIG, ...).
    """
    out = Path(out)
    check_folder_path(out)
    made = _make_parents(out.parent)
    tmp = None
    try:
        with folder_lock(out):
            _check_free(out, force)
            tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-{os.getpid()}-"))
            _honour_umask(tmp, directory=True)
            yield tmp
            for p in tmp.rglob("*"):  # writers inside may not honour it (safetensors' save_file: 0600)
                _honour_umask(p, directory=p.is_dir())
            _fault("built")
            check_folder_path(out)  # a link may have appeared meanwhile
            if not out.exists():
                os.replace(tmp, out)
                return
            if not force:
                raise FileExistsError(f"{out}: appeared while it was being built; pass --force to replace it")
            _swap_in(tmp, out)
    except BaseException as err:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        _remove_empty(made)
        _raise_write_error(err, out, (lock_path(out),) + ((tmp,) if tmp is not None else ()))


@contextlib.contextmanager
def working_folder(out: Path, keep: Callable[[Path], bool]) -> Iterator[Path]:
    """A folder a long run writes into as it goes (``finetune``: data caches, checkpoints, the drafter).

    OUT's lock is held while the body runs. On a failure, an OUT this call created is removed again
    (with the parents it created) unless ``keep(out)`` says it holds something worth resuming.

    Args:
        out: the folder (created if missing).
        keep: called after a failure: True keeps an OUT this call created.

    Yields:
        ``out``.

    Raises:
        NotAFolderError: ``out`` is a symbolic link or a file.
        FolderBusyError: another process is writing ``out``.
        OSError: a write failed; one without a file name is re-aimed at ``out``.
    """
    out = Path(out)
    check_folder_path(out)
    made = _make_parents(out)
    try:
        with folder_lock(out):
            yield out
    except BaseException as err:
        if made and made[-1] == out and not keep(out):
            shutil.rmtree(out, ignore_errors=True)
            _remove_empty(made[:-1])
        _raise_write_error(err, out, (lock_path(out),))
