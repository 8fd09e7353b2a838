"""File output that never leaves a half-written file: :func:`atomic_path`, used by every
command and module that writes results, heads, shards and figures, and the text and JSON
files written through it (:func:`write_text`, :func:`write_json`)."""
import contextlib
import json
import os
import tempfile

__all__ = ["atomic_path", "write_json", "write_text"]


def _umask() -> int:
    """The process's umask, read without changing it (os.umask would, for all threads)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


@contextlib.contextmanager
def atomic_path(path):
    """Yields a temporary file name beside ``path``; on leaving the block without an error
    the file is flushed to disk, given the permissions a plain ``open`` would give it, and
    renamed to ``path`` (atomic on POSIX), else removed."""
    folder = os.path.dirname(os.path.abspath(str(path)))
    try:
        fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(str(path)) + ".",
                                   suffix=".tmp", dir=folder)
    except OSError as e:  # the error names ``path``, not the temporary file
        raise OSError(e.errno, e.strerror, str(path)) from None
    os.close(fd)
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it private (0600)
        os.replace(tmp, str(path))
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_text(path, text: str) -> None:
    """``text`` in the file ``path``, written atomically."""
    with atomic_path(path) as tmp:
        with open(tmp, "w") as f:
            f.write(text)


def write_json(path, value) -> None:
    """``value`` as indented JSON in the file ``path``, written atomically."""
    write_text(path, json.dumps(value, indent=2) + "\n")
