"""A sweep's table: the CSV its rows are appended to one at a time (so an interrupted
sweep keeps every finished point, and a rerun skips them by ``point_id``), and the
one-line progress bar.

The table is read as text throughout: a pandas read could take an all-digit
``point_id`` for a number.
"""

from __future__ import annotations

import csv
import sys
import time
from pathlib import Path
from typing import Any, Callable

from commsim.api import Scenario
from commsim.sweep.grid import point_ids


def done_ids(path: Path) -> set[str]:
    """The ``point_id`` of every row already in the table (none when there is no table)."""
    if not path.exists():
        return set()
    with path.open(newline="") as f:
        return {r["point_id"] for r in csv.DictReader(f) if r.get("point_id")}


def read_header(path: Path) -> list[str] | None:
    if not path.exists():
        return None
    with path.open(newline="") as f:
        return next(csv.reader(f), None)


def append_row(path: Path, row: dict[str, Any], header: list[str] | None) -> list[str]:
    """Append ``row`` under ``header`` (the first row's keys make the header of a new table);
    returns the header now in the file."""
    if header is None:
        header = list(row)
        with path.open("w", newline="") as f:
            csv.writer(f).writerow(header)
    extra = [k for k in row if k not in header]
    if extra:  # a column the first rows lacked (they were errors): rewrite with the wider header
        import pandas as pd

        df = pd.read_csv(path, dtype=str, keep_default_na=False)
        header = header + extra
        df = df.reindex(columns=header)
        df.to_csv(path, index=False)
    with path.open("a", newline="") as f:
        csv.writer(f).writerow([row.get(k, "") for k in header])
    return header


def failed_points(path: str | Path, base: Scenario, grid: dict[str, list[Any]]) -> int:
    """How many points of ``grid`` have an error row in the table at ``path``."""
    ids = set(point_ids(base, grid))
    with Path(path).open(newline="") as f:
        return sum(1 for r in csv.DictReader(f) if r.get("point_id") in ids and r.get("error"))


def text_progress(stream=sys.stderr, clock: Callable[[], float] = time.perf_counter) -> Callable[[int, int], None]:
    """A one-line progress bar with rate and time left. Its clock starts at the last call
    with ``done == 0``: a backend that takes seconds to start (Ray) reports 0 again once up,
    so that its start-up does not count in the rate the time left comes from."""
    t0 = clock()

    def show(done: int, total: int) -> None:
        nonlocal t0
        if done == 0:
            t0 = clock()
        width = 30
        frac = done / total if total else 1.0
        bar = "#" * int(width * frac) + "-" * (width - int(width * frac))
        el = clock() - t0
        eta = el / done * (total - done) if done else 0.0
        stream.write(f"\rsweep [{bar}] {done}/{total} points, {el:.0f} s elapsed, ~{eta:.0f} s left ")
        if done == total:
            stream.write("\n")
        stream.flush()

    return show
