"""The one error policy (issue 53): which exceptions become one ``error:`` line and exit 2, with what text."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from slimspec_convert.atomic import write_error
from slimspec_convert.cli.errors import Interrupted, error_line


@pytest.mark.parametrize(
    "err, line",
    [
        (
            OSError(errno.ENOSPC, "No space left on device", "/runs/out"),
            "/runs/out: no space left on the device (ENOSPC); free space there or write to another disk",
        ),
        (
            PermissionError(errno.EACCES, "Permission denied", "/runs/out"),
            "/runs/out: permission denied (EACCES); make it writable for this user (chmod) or choose "
            "another path",
        ),
        (
            OSError(errno.EROFS, "Read-only file system", "/mnt/ro/out"),
            "/mnt/ro/out: read-only file system (EROFS); write to a folder on a writable file system",
        ),
        (
            NotADirectoryError(errno.ENOTDIR, "Not a directory", "/runs/file/out"),
            "/runs/file/out: a file where a folder is expected (ENOTDIR); remove or rename that file, or "
            "choose another",
        ),
        (OSError(errno.EIO, "Input/output error"), "input/output error on the device (EIO); check the disk "
         "(dmesg) and retry"),
        (ValueError("rank r=0: expected >= 1"), "rank r=0: expected >= 1"),
        (FileExistsError("out: already exists; pass --force"), "out: already exists; pass --force"),
        (
            KeyboardInterrupt(),
            "interrupted (Ctrl-C); temporary files were removed and an existing OUT was left as it was",
        ),
        (
            Interrupted("SIGTERM"),
            "interrupted (SIGTERM); temporary files were removed and an existing OUT was left as it was",
        ),
        (RuntimeError("a bug"), None),  # keeps its traceback
        (TypeError("a bug"), None),
        (OSError("an OSError without errno is ours, not the OS's"), None),
    ],
)  # fmt: skip
def test_error_line(err, line):
    assert error_line(err) == line


class SafetensorError(Exception):
    """Stands in for safetensors' own class (matched by name: atomic.py imports no third-party code)."""


def test_write_errors_name_the_final_path_not_the_temp_one():
    out, tmp = Path("/runs/out"), Path("/runs/.out.tmp-42-abc")
    efbig = write_error(OSError(errno.EFBIG, "File too large"), out, (tmp,))  # write(): no file name
    assert (efbig.errno, efbig.filename) == (errno.EFBIG, str(out))
    inside = write_error(OSError(errno.ENOSPC, "No space", str(tmp / "model.safetensors")), out, (tmp,))
    assert (inside.errno, inside.filename) == (errno.ENOSPC, str(out))
    source = OSError(errno.EIO, "I/O error", "/models/src/model.safetensors")  # a read of another file
    assert write_error(source, out, (tmp,)) is source
    st = write_error(SafetensorError("Error while serializing: I/O error: File too large (os error 27)"), out)
    assert (st.errno, st.filename) == (errno.EFBIG, str(out))
    corrupt = SafetensorError("Error while deserializing header: HeaderTooLarge")
    assert write_error(corrupt, out) is corrupt
    assert error_line(corrupt) == (
        "safetensors: Error while deserializing header: HeaderTooLarge; not a readable safetensors file "
        "(re-download or re-export it)"
    )


def test_a_writers_own_short_write_error_under_a_size_limit_becomes_efbig(tmp_path):
    """torch.save reports a write past ``ulimit -f`` as ``RuntimeError: ... unexpected pos``; the temp
    file at the limit says what happened. Run in a child with a 16 KiB RLIMIT_FSIZE (atomic.py alone)."""
    import resource
    import subprocess
    import sys
    import textwrap

    from tests.helpers.models import REPO

    child = textwrap.dedent(
        """
        import importlib.util, os, signal, sys
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        spec = importlib.util.spec_from_file_location("atomic", sys.argv[1])
        atomic = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(atomic)
        try:
            with atomic.atomic_path(sys.argv[2]) as tmp:
                with open(tmp, "wb") as f:
                    try:
                        f.write(b"x" * 40000)
                        f.flush()
                    except OSError:
                        raise RuntimeError("[enforce fail at inline_container.cc] unexpected pos 704")
        except OSError as e:
            print(e.errno, e.filename)
        """
    )

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (16384, 16384))

    out = tmp_path / "new" / "training_state.pt"
    res = subprocess.run(
        [sys.executable, "-c", child, str(REPO / "slimspec_convert" / "atomic.py"), str(out)],
        capture_output=True, text=True, preexec_fn=limit, timeout=60,
    )  # fmt: skip
    assert res.stdout.split() == [str(errno.EFBIG), str(out)], res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # the temp file and the folder made for it: gone
