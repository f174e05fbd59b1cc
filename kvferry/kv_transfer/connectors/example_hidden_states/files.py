"""Hidden-states files: their names, how they are written, and how a client reads them.

One safetensors file per request, ``<shared_storage_path>/<request id>.safetensors`` (the id
made safe for a file name), with two tensors, as vLLM writes them:

* ``hidden_states``: ``[num_tokens, num_layer_ids, hidden_size]`` in the model's dtype;
* ``token_ids``: ``[num_tokens]`` int64, the token whose forward produced each row.

The file's metadata also records ``layer_ids`` (comma separated). A file is written under a
temporary name in the same folder and renamed into place, so a reader never sees half a
file. With the synchronization lock on, the writer holds ``<file>.lock`` exclusively from the
request's first step until the file is in place; :func:`load_hidden_states` takes it shared
first, so it waits for the write instead of racing it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import time
import uuid

import torch
from safetensors.torch import load_file, save_file

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_MAX_STEM = 160


def safe_file_stem(req_id: str) -> str:
    """``req_id`` as a file name stem: kept when it is made of letters, digits, ``._-`` only
    (and does not start with a dot); otherwise those characters are kept, the others replaced
    by ``_``, and a digest of the whole id appended, so two ids never share a file."""
    stem = _UNSAFE.sub("_", req_id)[:_MAX_STEM]
    if stem == req_id and not stem.startswith(".") and stem:
        return stem
    digest = hashlib.sha256(req_id.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{stem.lstrip('.')}-{digest}" if stem.strip(".") else f"req-{digest}"


def hidden_states_filename(folder: str, req_id: str) -> str:
    return os.path.join(folder, f"{safe_file_stem(req_id)}.safetensors")


def take_write_lock(filename: str) -> int:
    """Create ``<filename>.lock`` and hold it exclusively; returns the descriptor (closing it
    releases the lock)."""
    os.makedirs(os.path.dirname(filename) or ".", exist_ok=True)
    fd = os.open(filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_hidden_states(
    filename: str,
    hidden_states: torch.Tensor,
    token_ids: list[int],
    layer_ids: tuple[int, ...],
    lock_fd: int | None,
) -> None:
    """Write one request's file atomically (temporary name, then rename), then release its
    lock (also when the write fails, so a reader is never left waiting)."""
    tmp = os.path.join(
        os.path.dirname(filename) or ".",
        f".{os.path.basename(filename)}.tmp-{uuid.uuid4().hex[:8]}",
    )
    try:
        os.makedirs(os.path.dirname(filename) or ".", exist_ok=True)
        tensors = {
            "hidden_states": hidden_states.contiguous(),
            "token_ids": torch.tensor(token_ids, dtype=torch.int64),
        }
        meta = {"format": "pt", "layer_ids": ",".join(map(str, layer_ids))}
        save_file(tensors, tmp, metadata=meta)
        os.replace(tmp, filename)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    finally:
        if lock_fd is not None:
            os.close(lock_fd)


def load_hidden_states(path: str, timeout: float | None = None) -> dict[str, torch.Tensor]:
    """Read a file written by the ExampleHiddenStatesConnector: ``{"hidden_states",
    "token_ids"}`` on the CPU. ``path`` is ``kv_transfer_params["hidden_states_path"]`` of
    the request's final output. When ``<path>.lock`` exists, waits (at most ``timeout``
    seconds, default forever) until the writer released it; raises ``TimeoutError`` after
    that, ``FileNotFoundError`` if no file was written (e.g. the request was aborted)."""
    lock = path + ".lock"
    if not os.path.exists(lock):
        return load_file(path, device="cpu")
    with open(lock) as f:
        if timeout is None:
            fcntl.flock(f, fcntl.LOCK_SH)
        else:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise TimeoutError(
                            f"{path} is still being written after {timeout}s"
                        ) from None
                    time.sleep(0.01)
        return load_file(path, device="cpu")


def cleanup_hidden_states(path: str, keep_hidden_states: bool = False) -> None:
    """Remove a request's lock file and, unless ``keep_hidden_states``, its file."""
    targets = [path + ".lock"] + ([] if keep_hidden_states else [path])
    for target in targets:
        with contextlib.suppress(FileNotFoundError):
            os.remove(target)
