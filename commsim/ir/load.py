"""Loading a schedule file in either of its forms, told apart by content.

The JSON form (``commsim.ir.serialize``) and the text form (``commsim.ir.text``) are
both accepted wherever a schedule file is read: the CLI, the Python API and the
executor. Errors name the file.
"""

from __future__ import annotations

from pathlib import Path

from commsim.ir.errors import ScheduleFormatError
from commsim.ir.schedule import Schedule
from commsim.ir.serialize import load_schedule
from commsim.ir.text import HEADER_PREFIX, schedule_from_text


def load_schedule_any(path: str | Path) -> Schedule:
    """A schedule from its JSON form or its text form (by its first line)."""
    p = Path(path)
    if p.suffix == ".gz":  # the JSON form, compressed
        return load_schedule(p)
    try:
        with p.open() as f:
            head = f.read(len(HEADER_PREFIX))
    except OSError as e:
        raise ScheduleFormatError(f"{p}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ScheduleFormatError(f"{p}: not a schedule (not text)") from None
    if head == HEADER_PREFIX:
        try:
            return schedule_from_text(p.read_text())
        except ScheduleFormatError as e:
            raise ScheduleFormatError(f"{p}: {e}") from None
    return load_schedule(p)
