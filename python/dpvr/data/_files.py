"""File access shared by the readers: existence checks, transparent gzip, and one error type."""

from __future__ import annotations

import gzip
import os
import zlib
from pathlib import Path

_GZIP_MAGIC = b"\x1f\x8b"


class DataFileError(ValueError):
    """A data file exists but cannot be parsed; the message names the file and the problem."""

    def __init__(self, path: str | os.PathLike[str], problem: str) -> None:
        super().__init__(f"{os.fspath(path)}: {problem}")
        self.path = Path(path)
        self.problem = problem


def require_file(path: str | os.PathLike[str]) -> Path:
    """Return ``path`` as a :class:`Path`, raising ``FileNotFoundError`` naming it if it is not a file."""
    path = Path(path)
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "no such file"
        raise FileNotFoundError(f"{path}: {what}")
    return path


def read_bytes(path: str | os.PathLike[str]) -> bytes:
    """Read a whole file, gunzipping it when it starts with the gzip magic (whatever its suffix)."""
    path = require_file(path)
    raw = path.read_bytes()
    if not raw.startswith(_GZIP_MAGIC):
        return raw
    try:
        return gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as err:
        raise DataFileError(path, f"corrupt or truncated gzip stream ({err})") from err
