"""Which large blocks of a measured executor run came back slow, by the age of the pages
they reused: the data behind ``commsim/sim/returned_pages.py``'s ramp, from the work
folders ``bench/validate_local.py`` keeps.

    python bench/returned_pages_fit.py /tmp/commsim-validate-XXXX [more folders]
    python bench/returned_pages_fit.py FOLDER --from-step 1 --period 2.05

For every executor row of a folder (``sched<i>.json`` with ``measured<i>.json`` and
``measured<i>.2.json``), each rank's step is walked in program order: a ``free`` of a
block at or above glibc's mmap ceiling (32 MiB) returns its pages at the end of the
host thread's last recorded op before it (the CPU executor runs kernels and frees on the
host thread, so program order is time order there); a large ``alloc`` reuses the
newest returns first (``ReturnedPages``' rule), and its pages' byte-weighted age is
taken from them (a block returns the pages it wrote; pages beyond what the rank
returned are "never" returned, as old as the guest's free memory). The allocation's
measured rate (ns a byte written) against the profile it was predicted with (the
profile's fast first-touch rate, and a reported page's extra) gives the share of its
bytes that came back slow. It prints the allocations by age bin with their mean slow
share, the model's share at each bin under ``--period``, and the least-squares ramp
(start and width, in seconds) over the allocations, beside the model's.

Runs before be1581c freed a waited reduce-scatter's buffers late (the executor kept its
work), so their program-order ages are wrong: use folders of later runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from commsim.hardware.profile import GLIBC_MMAP_THRESHOLD_MAX_BYTES  # noqa: E402
from commsim.sim.returned_pages import ReturnedPages  # noqa: E402

COLLECTIVE_KINDS = frozenset({"all_gather", "reduce_scatter", "all_reduce", "broadcast"})
AGE_BINS_S = (0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 2.75, 3.0, 4.0)
OLD_S = 1e9  # pages the rank never returned: the guest's free memory at large


@dataclass(frozen=True)
class Reuse:
    """One large allocation: the byte-weighted age of the pages it reused, and the share
    of its bytes that came back slow."""

    row: str
    rank: int
    step: int
    label: str
    mib: float
    age_s: float
    slow_share: float


def slow_share(ns_per_byte: float, fast_ns_per_byte: float, extra_ns_per_byte: float) -> float:
    """The share of a block's bytes that were reported pages, from its rate: the fast
    rate plus the share times the extra, clipped to [0, 1]."""
    assert extra_ns_per_byte > 0, "a reported page costs more than a fast one"
    return min(1.0, max(0.0, (ns_per_byte - fast_ns_per_byte) / extra_ns_per_byte))


def ramp_share(age_s: float, start_s: float, width_s: float) -> float:
    """A ramp's reported share at ``age_s``: none before ``start_s``, all from
    ``start_s + width_s``."""
    if width_s <= 0:
        return 1.0 if age_s >= start_s else 0.0
    return min(1.0, max(0.0, (age_s - start_s) / width_s))


def reuses(program: list[dict], rows: list[list], columns: list[str], row_name: str, fast: float, extra: float,
           from_step: int) -> list[Reuse]:
    """The large allocations of one rank's measured steps (``rows``: that rank's trace
    rows), each with the age of the pages it reused (see the module docstring)."""
    ix = {c: i for i, c in enumerate(columns)}
    by_step: dict[int, dict[int, tuple[int, int]]] = {}
    for r in rows:
        if r[ix["kind"]] in COLLECTIVE_KINDS:
            continue  # on the issuer threads, not the host's
        by_step.setdefault(r[ix["step"]], {})[r[ix["op_id"]]] = (r[ix["start_ns"]], r[ix["end_ns"]])
    sizes = {op["buffer"]: op for op in program if op["op"] == "alloc"}
    stack: list[list[float]] = []  # [bytes, freed at ns], newest last
    out = []
    for step in sorted(by_step):
        times = by_step[step]
        now = None
        for op in program:
            t = times.get(op["id"])
            if op["op"] == "free":
                a = sizes.get(op["buffer"])
                if a is not None and now is not None and a["size_bytes"] >= GLIBC_MMAP_THRESHOLD_MAX_BYTES:
                    stack.append([a.get("touch_bytes") or a["size_bytes"], now])  # the pages it had
                continue
            if t is None:
                continue
            if op["op"] == "alloc" and op["size_bytes"] >= GLIBC_MMAP_THRESHOLD_MAX_BYTES:
                written = op.get("touch_bytes") or op["size_bytes"]
                need, weighted = written, 0.0
                while need and stack:
                    got = min(need, stack[-1][0])
                    weighted += got * (t[0] - stack[-1][1]) / 1e9
                    stack[-1][0] -= got
                    need -= got
                    if stack[-1][0] == 0:
                        stack.pop()
                weighted += need * OLD_S
                if step >= from_step:
                    rate = (t[1] - t[0]) / written
                    out.append(Reuse(row_name, rows[0][ix["rank"]], step, op["label"], written / (1 << 20),
                                     weighted / written, slow_share(rate, fast, extra)))
            now = t[1]
    return out


def folder_reuses(folder: Path, from_step: int, skipped: list[str] | None = None) -> list[Reuse]:
    """Every executor row's large allocations in a validate_local work folder; the runs
    whose profile gives no reported page's extra (calibrate met no reported pages) are
    named in ``skipped``: a slow share needs that extra."""
    names = json.loads((folder / "rows.json").read_text())["rows"] if (folder / "rows.json").exists() else []
    out = []
    for sched_path in sorted(folder.glob("sched*.json")):
        i = sched_path.stem[len("sched"):]
        sched = json.loads(sched_path.read_text())
        name = names[int(i)] if i.isdigit() and int(i) < len(names) else f"row {i}"
        for suffix in ("", ".2"):
            measured, profile = folder / f"measured{i}{suffix}.json", folder / f"profile{i}.mean{suffix}.json"
            if not measured.exists() or not profile.exists():
                continue
            alloc = json.loads(profile.read_text()).get("alloc", {})
            fast, extra = alloc.get("first_touch_ns_per_byte"), alloc.get("reported_page_extra_ns_per_byte")
            trace = json.loads(measured.read_text())
            if "columns" not in trace:
                continue  # a framework row's step and phase times: no ops to walk
            if not fast or not extra:
                if skipped is not None:
                    what = "first-touch rate" if not fast else "reported page's extra"
                    skipped.append(f"{folder.name}: {name}, run {2 if suffix else 1}: {profile.name} has no {what}")
                continue
            cols = trace["columns"]
            for rank, prog_index in enumerate(sched["rank_program"]):
                rows = [r for r in trace["rows"] if r[0] == rank]
                if rows:
                    out += reuses(sched["programs"][prog_index]["step"], rows, cols, name, fast, extra, from_step)
    return out


def fit_ramp(data: list[Reuse], starts_s: list[float], widths_s: list[float]) -> tuple[float, float, float]:
    """(start, width, squared error) of the least-squares ramp over the grid given."""
    best = (0.0, 0.0, float("inf"))
    for s in starts_s:
        for w in widths_s:
            err = sum((ramp_share(r.age_s, s, w) - r.slow_share) ** 2 for r in data)
            if err < best[2]:
                best = (s, w, err)
    return best


def model_share(age_s: float, period_s: float) -> float:
    """``ReturnedPages.reported_share`` of pages ``age_s`` old at a ``period_s`` period."""
    return ReturnedPages(round(period_s * 1e9)).reported_share(round(age_s * 1e9))


def table(data: list[Reuse], period_s: float) -> list[str]:
    """Allocations by age bin: count, mean slow share, and the model's share."""
    lines = [f"{'age s':>10} {'allocations':>12} {'MiB':>8} {'slow share':>11} {'model':>7}"]
    edges = list(AGE_BINS_S) + [OLD_S, OLD_S + 1]
    for lo, hi in zip(edges, edges[1:]):
        sel = [r for r in data if lo <= r.age_s < hi]
        if not sel:
            continue
        mib = sum(r.mib for r in sel)
        share = sum(r.slow_share * r.mib for r in sel) / mib
        model = sum(model_share(r.age_s, period_s) * r.mib for r in sel) / mib
        label = "never" if lo >= OLD_S else f">={lo:g}" if hi >= OLD_S else f"{lo:g}-{hi:g}"
        lines.append(f"{label:>10} {len(sel):>12} {mib:>8.0f} {100 * share:>10.1f}% {100 * model:>6.1f}%")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", type=Path, help="validate_local work folders")
    ap.add_argument("--from-step", type=int, default=1,
                    help="first measured step counted (earlier steps only fill the returns; default 1)")
    ap.add_argument("--period", type=float, default=2.05,
                    help="the guest's reporting period in seconds for the model's column (default 2.05)")
    args = ap.parse_args()
    data: list[Reuse] = []
    skipped: list[str] = []
    for f in args.folders:
        if not f.is_dir():
            sys.exit(f"returned_pages_fit.py: {f}: not a folder")
        data += folder_reuses(f, args.from_step, skipped)
    for line in skipped:
        print(f"skipped {line}", file=sys.stderr)
    if not data:
        sys.exit("returned_pages_fit.py: no executor rows with measured runs and profiles in the folders given")
    print(f"{len(data)} large allocations ({len({(r.row, r.rank) for r in data})} row-ranks)")
    print("\n".join(table(data, args.period)))
    aged = [r for r in data if r.age_s < OLD_S]
    grid = [x / 20 for x in range(0, 121)]
    s, w, err = fit_ramp(aged, grid, grid)
    model = sum((model_share(r.age_s, args.period) - r.slow_share) ** 2 for r in aged)
    none = sum(r.slow_share ** 2 for r in aged)
    print(f"least-squares ramp over the {len(aged)} that reused returned pages: from {s:.2f} s, {w:.2f} s wide "
          f"(squared error {err:.1f}); the model's rule at a {args.period:.2f} s period ({model:.1f}); "
          f"none reported ({none:.1f})")


if __name__ == "__main__":
    main()
