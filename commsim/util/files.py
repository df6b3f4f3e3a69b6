"""Atomic file output: write a temporary file beside the target, then rename.

A crash or a bad input mid-way never leaves a half-written output behind. The file gets
the mode an ordinary write would give it: an existing target's own, else 0666 less the
umask (the temporary file is created 0600, which would otherwise be renamed into place).
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    try:
        os.fchmod(fd, _new_file_mode(path))
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _new_file_mode(path: Path) -> int:
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        return 0o666 & ~_umask()


def _umask() -> int:
    """The process's umask, read without changing it where Linux allows (os.umask can
    only be read by setting it, which would race with other threads)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


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


def output_problem(path: str | Path) -> str | None:
    """Why a file could not be written at ``path`` (by a rename in its folder), or None.

    Checked before any work, so that a bad output path fails in a second, not after the
    minutes the output took to compute. Writability is probed with a temporary file
    (removed at once): permission bits alone do not tell for root or read-only mounts.
    """
    p = Path(path)
    if p.is_dir():
        return "is a folder; give a file name"
    return _folder_problem(p.parent if str(p.parent) else Path("."))


def output_folder_problem(path: str | Path) -> str | None:
    """Why files could not be written into the folder ``path`` (created if missing: its
    parent must exist), or None."""
    p = Path(path)
    if p.exists():
        return _folder_problem(p) if p.is_dir() else "exists and is not a folder"
    return _folder_problem(p.parent if str(p.parent) else Path("."))


def _folder_problem(folder: Path) -> str | None:
    if not folder.exists():
        return f"folder {folder} does not exist"
    if not folder.is_dir():
        return f"{folder} is not a folder"
    try:
        fd, probe = tempfile.mkstemp(prefix=".commsim-probe.", dir=folder)
    except OSError as e:
        return f"folder {folder} is not writable ({e.strerror})"
    os.close(fd)
    os.unlink(probe)
    return None
