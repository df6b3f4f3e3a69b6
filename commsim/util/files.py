"""Atomic file output: write a temporary file beside the target, then rename.

A crash or a bad input mid-way never leaves a half-written output behind.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def read_json(path: str | Path, error: type[ValueError]) -> object:
    """Parse a JSON file; unreadable or malformed files raise ``error`` naming the file."""
    import json

    path = Path(path)
    try:
        if path.suffix == ".gz":  # traces are kept compressed in the repository
            import gzip

            return json.loads(gzip.decompress(path.read_bytes()).decode())
        return json.loads(path.read_text())
    except OSError as e:
        raise error(f"{path}: cannot read: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise error(f"{path}: not valid JSON (line {e.lineno}): {e.msg}") from None
