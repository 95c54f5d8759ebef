"""The one error policy of the CLI: which exceptions are the user's or the machine's (one line on stderr,
exit code 2) and which are bugs (traceback). docs/faults.md lists what each fault prints.

User errors are our own ``ValueError``/``KeyError`` and the file errors the library raises with a
full message. File-system and I/O failures (``OSError`` from the operating system: no permission, a
read-only file system, no space, a file-size limit, a file where a folder goes) and safetensors' own
errors get a line naming the path and what to do. An interrupted run (Ctrl-C, SIGTERM) gets a line
too: by then the write helpers have removed their temp entries and OUT is as it was.

The process ignores SIGXFSZ (a ``ulimit -f`` file-size limit): then a write past the limit fails
with ``EFBIG`` and is reported like any other, instead of the signal killing the process with a
core dump and leaving temp entries behind.
"""

from __future__ import annotations

import errno
import os
import signal

USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, KeyError)


class Interrupted(KeyboardInterrupt):
    """SIGTERM (or SIGHUP) received: unwinds like Ctrl-C, so every write helper cleans up."""


# errno -> (what it means, what to do); {path} is the path the OS named
_ADVICE = {
    errno.EACCES: ("permission denied", "make it writable for this user (chmod) or choose another path"),
    errno.EPERM: ("operation not permitted", "make it writable for this user or choose another path"),
    errno.EROFS: ("read-only file system", "write to a folder on a writable file system"),
    errno.ENOSPC: ("no space left on the device", "free space there or write to another disk"),
    errno.EDQUOT: ("disk quota exceeded", "free space within the quota or write to another disk"),
    errno.EFBIG: (
        "file too large (a file-size limit, see `ulimit -f`, or the file system's own)",
        "raise the limit (`ulimit -f unlimited`) or write to another file system",
    ),
    errno.ENOTDIR: ("a file where a folder is expected", "remove or rename that file, or choose another"),
    errno.EISDIR: ("a folder where a file is expected", "give a file path"),
    errno.ELOOP: ("too many levels of symbolic links", "replace the link loop by a real folder"),
    errno.ENAMETOOLONG: ("file name too long", "choose a shorter path"),
    errno.EIO: ("input/output error on the device", "check the disk (dmesg) and retry"),
    errno.EMFILE: ("too many open files", "raise `ulimit -n` and retry"),
    errno.ENOTEMPTY: ("folder not empty", "remove it or pass --force"),
    errno.EBUSY: ("device or resource busy", "retry when it is free, or choose another path"),
    errno.EXDEV: ("cross-device link", "keep OUT on one file system"),
}


def _os_error_line(err: OSError) -> str | None:
    """``{path}: {meaning}; {advice}`` for an error the OS raised (errno set), else None."""
    if err.errno is None:
        return None
    path = err.filename
    meaning, advice = _ADVICE.get(
        err.errno,
        (err.strerror or errno.errorcode.get(err.errno, str(err.errno)), "check the path and retry"),
    )
    code = errno.errorcode.get(err.errno, str(err.errno))
    if err.filename2 is not None:
        path = f"{os.fsdecode(path)} -> {os.fsdecode(err.filename2)}"
    where = f"{os.fsdecode(path)}: " if path is not None else ""
    return f"{where}{meaning} ({code}); {advice}"


def error_line(err: BaseException) -> str | None:
    """The one-line message for a user or machine fault, None for a bug (which keeps its traceback).

    Args:
        err: the exception a command raised.

    Returns:
        The message (no ``error:`` prefix, no newline), or None.
    """
    if isinstance(err, KeyboardInterrupt):
        why = "SIGTERM" if isinstance(err, Interrupted) else "Ctrl-C"
        return f"interrupted ({why}); temporary files were removed and an existing OUT was left as it was"
    if isinstance(err, OSError) and not isinstance(err, (FileNotFoundError, FileExistsError)):
        line = _os_error_line(err)
        if line is not None:
            return line
    if isinstance(err, USER_ERRORS):
        return str(err)
    if type(err).__name__ == "SafetensorError":
        return f"safetensors: {err}; not a readable safetensors file (re-download or re-export it)"
    return None


def _on_term(signum, frame) -> None:
    raise Interrupted(signal.Signals(signum).name)


def install_signal_handlers() -> None:
    """Ignore SIGXFSZ (writes past ``ulimit -f`` then fail with EFBIG); SIGTERM/SIGHUP unwind like Ctrl-C."""
    try:
        if hasattr(signal, "SIGXFSZ"):
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        for sig in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
            if sig is not None and signal.getsignal(sig) in (signal.SIG_DFL, None):
                signal.signal(sig, _on_term)
    except ValueError:  # not the main thread (an embedding application): leave its signals alone
        pass
