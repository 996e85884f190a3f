"""Files that must survive a crash: atomic replacement, the checkpoint format, write-ahead journals.

Every result and state file dpvr writes goes through :func:`atomic_write`, so a reader (or a resume after a
crash) sees the old file or the new one, never a mixture. A bottom layer: it imports the standard library
only (and torch, for the checkpoint codec, when a checkpoint is written or read, so that the command line
starts without torch), and knows nothing of what the files mean.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import secrets
from collections.abc import Mapping
from typing import Any

CHECKPOINT_MAGIC = b"DPVR-CHECKPOINT\n"
CHECKPOINT_VERSION = 2


def fsync_directory(directory: str | os.PathLike[str]) -> None:
    """Flushes ``directory``'s entries to disk: without it a rename or a new file may vanish in a crash
    even though the file's own bytes were flushed."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike[str], data: bytes, *, private: bool = False) -> None:
    """Replaces ``path`` by a file holding ``data``, atomically and durably.

    The bytes go to a temporary file in the same directory (a rename is atomic only within one file
    system), which is flushed to disk and renamed over ``path``; then the directory is flushed, so the
    rename survives a crash too. If anything fails the temporary file is removed and ``path`` is left as it
    was. Missing parent directories are created. ``private`` files are readable by their owner only (a
    checkpoint holds the noise seed); others get the permissions the process's umask gives a new file.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(8)}.tmp")
    # O_EXCL: a name clash (or a planted file or link) fails instead of being written through.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise
    fsync_directory(directory)


# ---- checkpoints ------------------------------------------------------------------------------------


def encode_checkpoint(state: Any, algorithm: str) -> bytes:
    """The checkpoint file of ``state`` (tensors in plain containers), written by ``algorithm``.

    Layout: :data:`CHECKPOINT_MAGIC`, a one-line JSON header (format version, ``algorithm``, payload length
    and SHA-256) and the payload, ``state`` as :func:`torch.save` writes it. The header lets a reader refuse
    a truncated, altered or foreign file before unpickling anything.
    """
    import torch  # the checkpoint codec alone needs torch: the command line writes results without it

    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    header = {
        "version": CHECKPOINT_VERSION,
        "algorithm": algorithm,
        "length": len(payload),
        "sha256": hashlib.sha256(payload).hexdigest(),
    }
    return CHECKPOINT_MAGIC + json.dumps(header).encode() + b"\n" + payload


def decode_checkpoint(data: bytes, path: str | os.PathLike[str], algorithm: str | None = None) -> Any:
    """The state an :func:`encode_checkpoint` file holds; ``path`` names the file in errors.

    Checks, in order, the magic line, the header, the format version, the payload's length and SHA-256 and
    (if given) the writing ``algorithm``, raising a ``ValueError`` naming the file and the first problem.
    Only then is the payload unpickled, with ``weights_only=True``: tensors and plain containers only, so
    even a file crafted to pass the checks cannot run code; a payload that holds anything else is refused
    too.
    """
    where = f"checkpoint {os.fspath(path)!r}"
    if not data.startswith(CHECKPOINT_MAGIC):
        raise ValueError(f"{where}: not a dpvr checkpoint (bad magic)")
    head, sep, payload = data[len(CHECKPOINT_MAGIC) :].partition(b"\n")
    try:
        header = json.loads(head) if sep else None
        version, length, digest = header["version"], int(header["length"]), str(header["sha256"])
    except (ValueError, TypeError, KeyError):
        raise ValueError(f"{where}: unreadable header (truncated?)") from None
    if version != CHECKPOINT_VERSION:
        raise ValueError(f"{where}: format version {version!r}, this dpvr reads {CHECKPOINT_VERSION}")
    if len(payload) != length:
        raise ValueError(f"{where}: truncated or padded ({len(payload)} payload bytes, header says {length})")
    if hashlib.sha256(payload).hexdigest() != digest:
        raise ValueError(f"{where}: checksum mismatch (the file was altered)")
    if algorithm is not None and header.get("algorithm") != algorithm:
        raise ValueError(f"{where}: written by {header.get('algorithm')!r}, not {algorithm}")
    import torch  # as in encode_checkpoint

    try:
        return torch.load(io.BytesIO(payload), weights_only=True)
    except Exception as err:  # an intact file that dpvr did not write: crafted, or another program's
        raise ValueError(
            f"{where}: the payload is not a state of tensors and plain containers ({type(err).__name__})"
        ) from err


def write_checkpoint(path: str | os.PathLike[str], state: Any, algorithm: str) -> None:
    """Writes ``state`` as a checkpoint of ``algorithm``, atomically and readable by its owner only (a
    state holds the noise seed: protect it like the data)."""
    atomic_write(path, encode_checkpoint(state, algorithm), private=True)


def read_checkpoint(path: str | os.PathLike[str], algorithm: str | None = None) -> Any:
    """The state a :func:`write_checkpoint` file holds, after :func:`decode_checkpoint`'s checks."""
    with open(path, "rb") as f:
        return decode_checkpoint(f.read(), path, algorithm)


# ---- journals ---------------------------------------------------------------------------------------


class Journal:
    """An append-only file of JSON lines, each on disk before :meth:`append` returns: a write-ahead log.

    What the entries mean is the owner's business; this class only makes them durable and reads them
    back. A missing file is an empty journal. A ``private`` journal's file, whenever this class creates
    it, is readable and writable by its owner only (an existing file keeps its mode).
    """

    def __init__(self, path: str | os.PathLike[str], *, private: bool = False) -> None:
        self.path = os.fspath(path)
        self.private = private

    def clear(self) -> None:
        """Empties the journal (atomically: a crash leaves the old entries or none)."""
        atomic_write(self.path, b"", private=self.private)

    def append(self, entry: Mapping[str, Any]) -> None:
        """Appends ``entry`` as one line and flushes it (and the directory, if this created the file)."""
        created = not os.path.exists(self.path)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600 if self.private else 0o666)
        with os.fdopen(fd, "ab") as f:
            f.write(json.dumps(entry, sort_keys=True).encode() + b"\n")
            f.flush()
            os.fsync(f.fileno())
        if created:
            fsync_directory(os.path.dirname(os.path.abspath(self.path)))

    def entries(self) -> list[Any]:
        """The entries in order. A line that is not JSON (a crash tore it mid-write) raises ``ValueError``:
        whether what it recorded happened cannot be known, so it is not guessed."""
        if not os.path.exists(self.path):
            return []
        with open(self.path, "rb") as f:
            lines = f.read().splitlines()
        entries = []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                entries.append(json.loads(line))
            except ValueError:
                raise ValueError(f"journal {self.path!r}: line {number} is not JSON (torn?)") from None
        return entries


__all__ = [
    "CHECKPOINT_MAGIC",
    "CHECKPOINT_VERSION",
    "Journal",
    "atomic_write",
    "decode_checkpoint",
    "encode_checkpoint",
    "fsync_directory",
    "read_checkpoint",
    "write_checkpoint",
]
