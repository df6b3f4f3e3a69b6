"""Every torch.distributed collective of a real training run, timed on every rank with one
clock: when each rank called it, when the call returned and when its wait ended.

    torchrun --standalone --nproc-per-node 2 bench/collective_timeline.py --out DIR \\
        runtime.examples.ds_train --model small-llama --seq 128 --ds-config ds.json --steps 8
    python bench/collective_timeline.py --report DIR [--last 0.5]

The first form runs the module (``python -m MODULE ARGS`` as each rank) with
``torch.distributed``'s all_gather_into_tensor, reduce_scatter_tensor, all_reduce and
broadcast wrapped: each call records its op, bytes, the call's start and return and, for
``async_op=True``, the end of its ``wait()`` (``time.perf_counter_ns``: CLOCK_MONOTONIC,
the same clock for every process of one machine), in ``DIR/rank{r}.json`` when the process exits. The
second pairs the ranks' calls in order and prints, per op and size over the last part of
the run (steady state): the calls, how long the call held rank 0 until its end, how far
apart the ranks called it, and the time from the last rank's call to the last end (the
collective itself once everyone is there). Blocking calls are what a step's prediction
prices from calibrate's points; an async call's start-to-wait spans whatever the
framework did meanwhile. Local ranks only (one clock).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WRAPPED = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "broadcast")


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size() if hasattr(t, "numel") else 0


class _TimedWork:
    """A backend's work handle whose ``wait()`` records its end in ``rec``."""

    def __init__(self, work: Any, rec: dict) -> None:
        self._work, self._rec = work, rec

    def wait(self, *a: Any, **k: Any) -> Any:
        out = self._work.wait(*a, **k)
        self._rec["end_ns"] = time.perf_counter_ns()
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def wrap(dist: Any, records: list[dict]) -> None:
    """Replace ``dist``'s collectives with timed ones that append to ``records``."""
    for name in WRAPPED:
        orig = getattr(dist, name)

        def timed(*a: Any, _orig: Any = orig, _name: str = name, **k: Any) -> Any:
            tensors = list(a[:2]) + [k.get(n) for n in ("output", "input", "output_tensor", "input_tensor", "tensor")]
            rec = {"op": _name, "bytes": max(_nbytes(t) for t in tensors), "start_ns": time.perf_counter_ns()}
            work = _orig(*a, **k)
            rec["return_ns"] = time.perf_counter_ns()
            rec["end_ns"] = rec["return_ns"] if not k.get("async_op") else None
            records.append(rec)
            return _TimedWork(work, rec) if k.get("async_op") and work is not None else work

        setattr(dist, name, timed)


def pair_stats(ranks: list[list[dict]], last: float = 0.5) -> dict[tuple[str, int], dict[str, float]]:
    """(op, bytes) -> mean ms of: ``held`` (rank 0's start to its end), ``skew`` (first to
    last rank's start), ``together`` (last start to last end), and ``calls``; over the
    last ``last`` share of the calls every rank made, paired in order. Calls whose wait
    was never recorded are left out."""
    if not ranks or not 0 < last <= 1:
        raise ValueError(f"last {last}: a share in (0, 1], and at least one rank")
    n = min(len(r) for r in ranks)
    acc: dict[tuple[str, int], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for i in range(n - int(n * last), n):
        calls = [r[i] for r in ranks]
        ops = {c["op"] for c in calls}
        if len(ops) != 1:
            raise ValueError(f"call {i}: the ranks called different collectives {sorted(ops)}; not one run's records")
        if any(c["end_ns"] is None for c in calls):
            continue
        starts, ends = [c["start_ns"] for c in calls], [c["end_ns"] for c in calls]
        a = acc[(calls[0]["op"], calls[0]["bytes"])]
        a["held"].append((ends[0] - starts[0]) / 1e6)
        a["skew"].append((max(starts) - min(starts)) / 1e6)
        a["together"].append((max(ends) - max(starts)) / 1e6)
    return {k: {**{m: statistics.fmean(v) for m, v in a.items()}, "calls": float(len(a["held"]))}
            for k, a in sorted(acc.items())}


def report(folder: Path, last: float) -> str:
    files = sorted(folder.glob("rank*.json"), key=lambda p: int(p.stem[4:]))
    if len(files) < 2:
        raise ValueError(f"{folder}: needs rank0.json, rank1.json, ... from a run under torchrun; found {len(files)}")
    stats = pair_stats([json.loads(p.read_text()) for p in files], last)
    lines = [f"{'op':<24}{'MiB':>9}{'calls':>7}{'held ms':>10}{'skew ms':>10}{'together ms':>13}"]
    for (op, nbytes), s in stats.items():
        lines.append(f"{op:<24}{nbytes / 2**20:>9.3f}{s['calls']:>7.0f}{s['held']:>10.2f}{s['skew']:>10.2f}"
                     f"{s['together']:>13.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="run MODULE as this rank, its records into OUT/rank{r}.json")
    ap.add_argument("--report", type=Path, metavar="DIR", help="print the ranks' paired timings of a finished run")
    ap.add_argument("--last", type=float, default=0.5, help="with --report: the share of the calls to read (the end)")
    ap.add_argument("module", nargs="?")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    if a.report:
        try:
            print(report(a.report, a.last))
        except (ValueError, OSError) as e:
            print(f"collective_timeline: --report {a.report}: {e}", file=sys.stderr)
            return 2
        return 0
    if not (a.out and a.module):
        ap.error("give --out DIR MODULE [ARGS] (under torchrun) or --report DIR")
    import runpy

    import torch.distributed as dist

    records: list[dict] = []
    wrap(dist, records)
    a.out.mkdir(parents=True, exist_ok=True)
    dest = a.out / f"rank{os.environ.get('RANK', '0')}.json"

    def save() -> None:
        tmp = dest.with_suffix(".tmp")
        tmp.write_text(json.dumps(records))
        tmp.replace(dest)

    # at exit, not after run_module: a training script may leave through os._exit once its
    # exit handlers have run (runtime/examples/ds_train.py does)
    atexit.register(save)
    sys.path.insert(0, str(ROOT))  # the repository's modules (runtime.examples.*), as python -m from its root
    sys.argv = [a.module, *a.args]
    runpy.run_module(a.module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
