"""File output that never leaves a half-written file: :func:`atomic_path`, used by every
command and module that writes results, heads, shards and figures, the text and JSON
files written through it (:func:`write_text`, :func:`write_json`), and :func:`save_state`
/ :func:`load_state`, a training state (model, optimiser, schedule, random generator) in a
file whose loading runs no code (no pickle)."""
import contextlib
import json
import os
import tempfile

__all__ = ["atomic_path", "load_state", "save_state", "write_json", "write_text"]


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


_STATE_KEY = "headscope_state"  # the safetensors metadata entry holding the JSON


def _encode(value, tensors: dict):
    """``value`` as JSON, every container tagged with its type (so that tuples and the
    integer keys of an optimiser's state come back as they were) and every tensor replaced
    by its name in ``tensors``."""
    import torch
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        name = f"t{len(tensors)}"
        # a copy of its own: safetensors refuses tensors that share memory (tied weights)
        tensors[name] = value.detach().cpu().clone().contiguous()
        return {"tensor": name}
    if isinstance(value, dict):
        return {"dict": [[_encode(k, tensors), _encode(v, tensors)] for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        return {type(value).__name__: [_encode(v, tensors) for v in value]}
    raise TypeError(f"headscope.io.save_state: a {type(value).__name__} cannot be stored "
                    f"without pickling; allowed: dicts, lists, tuples, str, int, float, bool, "
                    f"None and tensors")


def _decode(value, tensors):
    if not isinstance(value, dict):
        return value
    (kind, inner), = value.items()
    if kind == "tensor":
        return tensors.get_tensor(inner)
    if kind == "dict":
        return {_hashable(_decode(k, tensors)): _decode(v, tensors) for k, v in inner}
    items = [_decode(v, tensors) for v in inner]
    return tuple(items) if kind == "tuple" else items


def _hashable(key):
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


def save_state(path, state) -> None:
    """Writes ``state`` (nested dicts, lists and tuples of str, int, float, bool, None and
    tensors: ``state_dict()``s, ``torch.get_rng_state()``) to ``path`` atomically: the
    tensors as a safetensors file, the rest as JSON in its metadata."""
    from safetensors.torch import save_file
    tensors: dict = {}
    skeleton = json.dumps(_encode(state, tensors))
    with atomic_path(path) as tmp:
        save_file(tensors, tmp, metadata={_STATE_KEY: skeleton})


def load_state(path):
    """The state :func:`save_state` wrote to ``path``, on the CPU; ``ValueError`` naming the
    file when it is not one."""
    from safetensors import safe_open
    try:
        with safe_open(str(path), framework="pt") as tensors:
            skeleton = (tensors.metadata() or {}).get(_STATE_KEY)
            state = None if skeleton is None else _decode(json.loads(skeleton), tensors)
    except Exception as e:  # safetensors raises several types for damaged files
        raise ValueError(f"{path}: not a readable state file (truncated or not safetensors): "
                         f"{e}") from e
    if skeleton is None:
        raise ValueError(f"{path}: a safetensors file without a headscope state")
    return state
