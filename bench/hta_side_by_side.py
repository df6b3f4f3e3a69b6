"""A prediction and the measurement of one stored row, as Kineto traces side by side:
the picture docs/img/predicted_vs_measured.png.

    python bench/hta_side_by_side.py                  # row small_z3_small_buckets
    python bench/hta_side_by_side.py --row small_z3_opt --out /tmp/row.png --keep /tmp/kineto

A row of the local grid in traces/local-cpu/ holds the schedule that ran
(``<row>.schedule.json.gz``), the measured trace (``<row>.json.gz``, ``commsim execute`` on
gloo) and the profile calibrated around the run (``<row>.profile.json``). The script
predicts the schedule with that profile (as bench/validate_local.py does), writes both
traces as Kineto folders (``commsim.report.kineto``), loads each with Holistic Trace
Analysis and prints its temporal breakdown and communication / computation overlap, then
draws rank 0's step from the Kineto files: the predicted step above the measured one
closest to the median measured step, on one time axis, one lane per stream (the host
thread, then the device streams), coloured by what runs. Needs HTA and matplotlib.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HTA_DISABLE_NS_ROUNDING", "1")  # keep nanoseconds: kernels of a few us matter
os.environ.setdefault("MPLBACKEND", "Agg")

from commsim.api import Scenario, predict  # noqa: E402
from commsim.ir.trace import Trace  # noqa: E402
from commsim.report.kineto import file_name, write_kineto  # noqa: E402

COLOURS = {"compute kernel": "#4c72b0", "collective (NCCL-named)": "#dd5444", "copy": "#55a868",
           "launch / sync (cuda_runtime)": "#555555", "host op (cpu_op)": "#b8b8b8"}


def what(e: dict) -> str:
    if e["cat"] == "kernel":
        return "collective (NCCL-named)" if e["name"].startswith("nccl") else "compute kernel"
    if e["cat"] == "gpu_memcpy":
        return "copy"
    return "launch / sync (cuda_runtime)" if e["cat"] == "cuda_runtime" else "host op (cpu_op)"


def lanes(doc: dict, step: int) -> tuple[list[str], dict[tuple[int, int], list[dict]], float, float]:
    """(lane names, (pid, tid) -> the step's events, step start us, step length us) of one file."""
    ev = doc["traceEvents"]
    span = next(e for e in ev if e.get("cat") == "user_annotation" and e["name"] == f"ProfilerStep#{step}")
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
    by_lane: dict[tuple[int, int], list[dict]] = {}
    for e in ev:
        if e["ph"] == "X" and e["cat"] != "user_annotation" and e["args"].get("step") == step:
            by_lane.setdefault((e["pid"], e["tid"]), []).append(e)
    order = sorted(by_lane, key=lambda k: (k[0] < 1_000_000, k[1]))  # the host thread first, then streams by id
    return ["host thread" if k[0] >= 1_000_000 else names[k] for k in order], {k: by_lane[k] for k in order}, \
        span["ts"], span["dur"]


def draw(pred_doc: dict, meas_doc: dict, meas_step: int, title: str, out: Path) -> None:
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    panels = [("predicted", pred_doc, 0), (f"measured (step {meas_step})", meas_doc, meas_step)]
    fig, axes = plt.subplots(2, 1, figsize=(12, 4.6), sharex=True, layout="constrained")
    for ax, (label, doc, step) in zip(axes, panels):
        names, by_lane, t0, length = lanes(doc, step)
        for y, events in enumerate(by_lane.values()):
            for kind, colour in COLOURS.items():
                bars = [((e["ts"] - t0) / 1000, max(e["dur"], 0.0) / 1000) for e in events if what(e) == kind]
                if bars:
                    ax.broken_barh(bars, (y - 0.38, 0.76), facecolors=colour, linewidth=0)
        ax.set_yticks(range(len(names)), names, fontsize=8)
        ax.set_ylim(len(names) - 0.5, -0.5)
        ax.set_title(f"{label}: {length / 1e3:.0f} ms", fontsize=9, loc="left")
        ax.tick_params(axis="x", labelsize=8)
    axes[-1].set_xlabel("ms from the step's start (rank 0)", fontsize=8)
    axes[0].legend(handles=[Patch(color=c, label=k) for k, c in COLOURS.items()], fontsize=7, ncols=5,
                   loc="lower right", bbox_to_anchor=(1, 1.12), frameon=False)
    fig.suptitle(title, fontsize=10, x=0.01, ha="left")
    fig.savefig(out, dpi=90)


def hta_figures(folder: Path) -> str:
    import logging

    from hta.trace_analysis import TraceAnalysis

    logging.getLogger("hta").setLevel(logging.ERROR)  # its progress lines

    a = TraceAnalysis(trace_dir=str(folder))
    t = a.get_temporal_breakdown(visualize=False).set_index("rank")
    o = a.get_comm_comp_overlap(visualize=False).set_index("rank")
    return "\n".join(f"  rank {r}: idle {t.loc[r, 'idle_time_pctg']:.1f}%, compute {t.loc[r, 'compute_time_pctg']:.1f}%, "
                     f"non-compute {t.loc[r, 'non_compute_time_pctg']:.1f}%, comm/comp overlap "
                     f"{o.loc[r, 'comp_comm_overlap_pctg']:.1f}%" for r in t.index)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--row", default="small_z3_small_buckets", help="a row stored in traces/local-cpu/")
    ap.add_argument("--out", default=str(ROOT / "docs" / "img" / "predicted_vs_measured.png"), help="PNG to write")
    ap.add_argument("--keep", metavar="DIR", help="keep the Kineto folders here (DIR/predicted, DIR/measured)")
    args = ap.parse_args()
    base = ROOT / "traces" / "local-cpu" / args.row
    measured = Trace.load(f"{base}.json.gz")
    world = int(measured.meta.get("world_size"))
    pred = predict(Scenario(schedule=f"{base}.schedule.json.gz", nodes=1, gpus_per_node=world,
                            hw_profile=f"{base}.profile.json", runner="executor"))  # the executor measured it
    with tempfile.TemporaryDirectory(prefix="commsim-kineto.") as tmp:
        keep = Path(args.keep or tmp)
        keep.mkdir(parents=True, exist_ok=True)
        folders = {"predicted": keep / "predicted", "measured": keep / "measured"}
        write_kineto(pred.trace(), folders["predicted"], world_size=world)
        write_kineto(measured, folders["measured"])
        for name, folder in folders.items():
            print(f"{name}: HTA's figures{' (all steps but the last)' if name == 'measured' else ''}"
                  + (f", Kineto traces in {folder}" if args.keep else ""))
            print(hta_figures(folder))
        docs = [json.loads((folders[n] / file_name(0)).read_text()) for n in ("predicted", "measured")]
    times = measured.meta.get("step_times_ns")
    step = min(range(len(times)), key=lambda s: abs(times[s] - statistics.median(times)))
    title = (f"traces/local-cpu/{args.row}: predicted with its profile ({pred.metrics.step_time_s:.2f} s) vs "
             f"measured on gloo (median of {len(times)} steps {statistics.median(times) / 1e9:.2f} s), from the Kineto "
             "traces")
    draw(docs[0], docs[1], step, title, Path(args.out))
    print(f"{args.out}: rank 0, predicted step vs measured step {step} (the median of {len(times)})")


if __name__ == "__main__":
    main()
