"""Checkpoint files that say when they are not what they claim to be.

A checkpoint file is one rank's state (tensors, numbers, strings, lists and dicts of them:
what ``torch.load(weights_only=True)`` accepts), written as::

    b"overlap-checkpoint 1\\n"                      magic and format version
    {"bytes": n, "sha256": "...", "config": {...}}\\n one JSON line: the payload's size and
                                                    checksum, and the run's config
    payload                                         torch.save of the state (n bytes)

``load`` reads the header, checks the payload's size and SHA-256 before unpickling
anything, then unpickles it with ``weights_only=True`` (a checkpoint file cannot run
code). So a flipped byte, a run of bytes overwritten in a weight, a truncated file or a
file that is not a checkpoint at all (a plain ``torch.save`` file) raises
``CheckpointError`` naming the file and what is wrong with it, before any state is used.
torch.save's own zip records carry CRC-32s that ``torch.load`` does not check, hence the
checksum here.

``save`` writes to a temporary file and renames it over the old one: a process killed
mid-save leaves the previous checkpoint whole.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path
from typing import Any

import torch

__all__ = ["CheckpointError", "MAGIC", "load", "read_config", "save"]

MAGIC = b"overlap-checkpoint 1\n"
_MAX_HEADER = 1 << 20  # a header line longer than this is not ours


class CheckpointError(ValueError):
    """A checkpoint file is missing, corrupt, truncated, or not a checkpoint."""


def save(path: str | os.PathLike, state: dict[str, Any], config: dict[str, Any]) -> None:
    """Write ``state`` (loadable with ``weights_only=True``) and the run's ``config``
    (JSON-serializable) to ``path``, atomically."""
    path = Path(path)
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getbuffer()
    header = json.dumps({"bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest(),
                         "config": config}, sort_keys=True).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(MAGIC)
        f.write(header + b"\n")
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _read_header(f: Any, path: Path) -> dict[str, Any]:
    magic = f.read(len(MAGIC))
    if magic != MAGIC:
        hint = " (a zip archive: a plain torch.save file?)" if magic.startswith(b"PK") else ""
        raise CheckpointError(f"{path} is not an overlap checkpoint: it starts with {magic[:16]!r}{hint}")
    line = f.readline(_MAX_HEADER)
    try:
        header = json.loads(line)
        n, digest, config = int(header["bytes"]), str(header["sha256"]), header["config"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path}: the checkpoint's header is unreadable ({exc})") from None
    if n < 0 or len(digest) != 64 or not isinstance(config, dict):
        raise CheckpointError(f"{path}: the checkpoint's header is invalid: {line[:200]!r}")
    return {"bytes": n, "sha256": digest, "config": config}


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """The run's config stored in the checkpoint at ``path`` (reads the header only)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            return _read_header(f, path)["config"]
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from None


def load(path: str | os.PathLike, map_location: Any = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(state, config)`` from the checkpoint at ``path``, its checksum verified first.

    Raises:
        CheckpointError: the file is missing or unreadable, is not a checkpoint, is
            truncated or longer than its header says, its checksum does not match, or its
            payload is not loadable with ``weights_only=True``.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            header = _read_header(f, path)
            payload = f.read(header["bytes"] + 1)
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from None
    if len(payload) != header["bytes"]:
        what = "truncated" if len(payload) < header["bytes"] else "longer than its header says"
        raise CheckpointError(f"{path} is {what}: its header says {header['bytes']} bytes of state, "
                              f"the file holds {len(payload) if len(payload) <= header['bytes'] else 'more'}")
    digest = hashlib.sha256(payload).hexdigest()
    if digest != header["sha256"]:
        raise CheckpointError(f"{path} is corrupt: the SHA-256 of its state is {digest[:16]}..., its header "
                              f"says {header['sha256'][:16]}... (changed on disk, or written by something else)")
    try:
        state = torch.load(io.BytesIO(payload), map_location=map_location, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - whatever the unpickler says, it is this file's fault
        raise CheckpointError(f"{path}: its state does not load with weights_only=True: {exc}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: its state is a {type(state).__name__}, not a dict")
    return state, header["config"]
