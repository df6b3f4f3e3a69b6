"""Plots of predictions and sweeps (matplotlib; figures for notebooks, PNGs for the CLI).

* ``timeline``: one step per rank and stream, ops coloured by kind, the compute
  stream's stalls shaded by cause, host blocks hatched, allocator flushes marked;
* ``stall_bars``: where each scenario's step time goes (compute, then each stall cause),
  with a table of the seconds beside the bars; bars named column=value;
* ``scaling``: a metric (TFLOPS per GPU by default) against cluster size, one line per
  group of a sweep table;
* ``memory``: allocated and reserved memory over the step, flushes marked.

Every function returns a ``matplotlib.figure.Figure``; ``save_png`` writes one
atomically. The Agg backend is used unless a notebook already chose one.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Iterable, Sequence

from commsim.ir import ops as O
from commsim.report.metrics import COMPUTE_STREAM, STALL_CAUSES, stall_intervals
from commsim.sim.records import HOST, SimResult

COLOURS = {
    "gemm": "#4c72b0", "attention": "#55a868", "elementwise": "#8172b2", "optimizer": "#937860",
    "embedding": "#64b5cd", "reduction": "#6f4e7c", "norm": "#2ca02c", "softmax": "#ff9f9b",
    "dropout": "#9467bd", "all_gather": "#dd8452", "reduce_scatter": "#c44e52", "all_reduce": "#da8bc3",
    "broadcast": "#ccb974", "copy": "#8c8c8c", "host": "#bbbbbb",
}
# Stall causes get a palette of their own, far from every op kind's colour, so that a
# strip of "waiting for all-gather" is never read as an all-gather running (from
# Trubetskoy's 20 distinct colours). "compute" (busy) in the stall bars is the GEMM colour.
STALL_COLOURS = {
    "compute": COLOURS["gemm"], "all_gather": "#ffe119", "reduce_scatter": "#f032e6", "other_comm": "#bfef45",
    "straggler": "#000000", "host": "#000075", "allocator_flush": "#800000", "allocator": "#aaffc3",
    "other": "#dcbeff",
}


def _plt():
    import matplotlib

    if "matplotlib.pyplot" not in __import__("sys").modules:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig: Any, path: str | Path, dpi: int = 110) -> None:
    """Write a figure as PNG through a temporary file (never half-written), and close it."""
    from commsim.util.files import atomic_write_bytes

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    _plt().close(fig)
    atomic_write_bytes(path, buf.getvalue())


def _colour(op: O.Op) -> str:
    if isinstance(op, (O.Compute, O.Collective)):
        return COLOURS.get(op.kind.value, "#999999")
    if isinstance(op, O.Copy):
        return COLOURS["copy"]
    return COLOURS["host"]


def _scale(ns: int) -> tuple[float, str]:
    return (1e-3, "us") if ns < 5e8 else (1e-9, "s")


def timeline(result: SimResult, title: str = "", max_ranks: int = 4, ranks: Sequence[int] | None = None):
    """Per rank and stream, ops as bars coloured by kind; under each compute stream its
    stalls shaded by cause; host blocks hatched; allocator flushes as red dashes."""
    plt = _plt()
    from matplotlib.patches import Patch

    ranks = list(ranks) if ranks is not None else sorted(result.ranks)[:max_ranks]
    rows: list[tuple[int, str]] = []
    for r in ranks:
        streams = sorted({rec.stream for rec in result.ranks[r].records if rec.stream != HOST},
                         key=lambda s: (s != COMPUTE_STREAM, s))
        rows.extend((r, s) for s in streams)
        rows.append((r, HOST))
    index = {row: i for i, row in enumerate(rows)}
    # constrained layout keeps room below the axis for the legends (tight_layout did not)
    fig, ax = plt.subplots(figsize=(14, 0.45 * len(rows) + 2.6), layout="constrained")
    scale, unit = _scale(result.step_time_ns)
    for r in ranks:
        rr = result.ranks[r]
        by_row: dict[int, tuple[list, list]] = {}
        for rec in rr.records:
            if rec.stream == HOST and not isinstance(rec.op, O.HostWork):
                continue
            y = index[(r, rec.stream)]
            spans, cols = by_row.setdefault(y, ([], []))
            spans.append((rec.start_ns * scale, max(rec.end_ns - rec.start_ns, 1) * scale))
            cols.append(_colour(rec.op))
        for y, (spans, cols) in by_row.items():
            ax.broken_barh(spans, (y - 0.4, 0.8), facecolors=cols, linewidth=0)
        if (r, COMPUTE_STREAM) in index:
            y = index[(r, COMPUTE_STREAM)]
            stalls = stall_intervals([x for x in rr.records if x.stream != HOST], rr.host_blocks,
                                     result.step_time_ns)
            if stalls:
                ax.broken_barh([(a * scale, (b - a) * scale) for a, b, _ in stalls], (y + 0.42, 0.16),
                               facecolors=[STALL_COLOURS[c] for _, _, c in stalls], linewidth=0)
        hy = index[(r, HOST)]
        blocked = [(hb.start_ns * scale, (hb.end_ns - hb.start_ns) * scale) for hb in rr.host_blocks]
        if blocked:
            ax.broken_barh(blocked, (hy - 0.4, 0.8), facecolors="none", edgecolor="#444444", hatch="///",
                           linewidth=0.3)
        for t in rr.flush_times_ns:
            ax.axvline(t * scale, color="red", linewidth=0.8, linestyle="--")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {r} {s}" for r, s in rows])
    ax.set_ylim(len(rows) - 0.4, -0.6)
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(title or "step timeline", fontsize=9)
    ops = [Patch(color=c, label=k) for k, c in COLOURS.items()]
    ops.append(Patch(facecolor="none", edgecolor="#444444", hatch="///", label="host blocked"))
    stalls = [Patch(color=STALL_COLOURS[c], label=f"stall: {c}") for c in STALL_CAUSES]
    fig.legend(handles=ops, loc="outside lower left", ncol=6, fontsize=7, title="ops by kind", title_fontsize=7)
    fig.legend(handles=stalls, loc="outside lower right", ncol=4, fontsize=7, title_fontsize=7,
               title="compute stream idle, by cause (the strip under each compute row)")
    return fig


def timeline_png(result: SimResult, path: str | Path, title: str = "", max_ranks: int = 4) -> None:
    save_png(timeline(result, title, max_ranks), path)


def _stall_rows(items: Any, label: str | Sequence[str] | None) -> list[tuple[str, float, dict[str, float]]]:
    """(label, compute seconds, stalls) from a sweep DataFrame or (label, Metrics) pairs."""
    rows = []
    if hasattr(items, "iterrows"):
        cols = [label] if isinstance(label, str) else list(label or [])
        for _, row in items.iterrows():
            err, oom = row.get("error"), row.get("oom")
            if (isinstance(err, str) and err) or (isinstance(oom, str) and oom):
                continue  # no step time to split
            stalls = {c: float(row.get(f"stall_{c}_s", 0.0) or 0.0) for c in STALL_CAUSES}
            # name=value: "2 efa 2" did not say which value is the stage and which the nodes
            name = " ".join(f"{c}={row[c]}" for c in cols) if cols else str(row.get("point_id", ""))
            rows.append((name, float(row["step_time_s"]) - sum(stalls.values()), stalls))
        return rows
    for name, m in items:
        stalls = {c: float(m.stalls_s.get(c, 0.0)) for c in STALL_CAUSES}
        rows.append((str(name), m.step_time_s - sum(stalls.values()), stalls))
    return rows


def stall_bars(items: Any, label: str | Sequence[str] | None = None, title: str = ""):
    """Horizontal stacked bars: each scenario's step time as compute plus each stall
    cause, and beside them a table of the same seconds, one row per bar and one column
    per cause (its colour above its name: the table is the legend). ``items``: a sweep
    DataFrame (``label`` names the column(s) to label bars by, as column=value) or an
    iterable of ``(label, Metrics)``."""
    plt = _plt()
    from matplotlib.patches import Rectangle

    rows = _stall_rows(items, label)
    present = [c for c in ("compute", *STALL_CAUSES)
               if any((compute if c == "compute" else stalls[c]) >= _SHOWN_S for _, compute, stalls in rows)]
    columns = ["step", *present]
    fig, (ax, table) = plt.subplots(1, 2, sharey=True, layout="constrained",
                                    figsize=(7 + 0.6 * len(columns), 0.45 * len(rows) + 2.0),
                                    width_ratios=(7, 0.6 * len(columns)))
    for i, (name, compute, stalls) in enumerate(rows):
        left = 0.0
        for cause, value in (("compute", compute), *stalls.items()):
            if value <= 0:
                continue
            ax.barh(i, value, left=left, color=STALL_COLOURS[cause], label=cause)
            left += value
        values = {"step": left, "compute": compute, **stalls}
        for j, c in enumerate(columns):
            shown = _seconds(values[c]) if values[c] >= _SHOWN_S else "-"
            table.text((j + 0.5) / len(columns), i, shown, transform=table.get_yaxis_transform(),
                       ha="center", va="center", fontsize=7)
    # header: each cause's colour, then its name (on two lines where it has two words)
    for j, c in enumerate(columns):
        x = (j + 0.5) / len(columns)
        if c != "step":
            table.add_patch(Rectangle((x - 0.3 / len(columns), -1.55), 0.6 / len(columns), 0.3,
                                      transform=table.get_yaxis_transform(), color=STALL_COLOURS[c],
                                      clip_on=False))
        table.text(x, -0.85, c.replace("_", "\n", 1), transform=table.get_yaxis_transform(), ha="center",
                   va="center", fontsize=7)
    table.axis("off")
    table.set_title("seconds", fontsize=8)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([r[0] for r in rows], fontsize=8)
    ax.set_ylim(len(rows) - 0.5, -1.7)  # top to bottom, with room for the table's header
    ax.set_xlabel("seconds per step (compute stream: busy, then idle by cause)")
    ax.set_title(title or "where the step time goes", fontsize=9)
    return fig


_SHOWN_S = 0.0005  # below the table's resolution


def _seconds(v: float) -> str:
    return f"{v:.3f}"


def scaling(df: Any, x: str = "nodes", y: str = "model_tflops_per_gpu", hue: str | Sequence[str] | None = None,
            title: str = "", logx: bool = True):
    """``y`` against ``x`` from a sweep table, one line per value of ``hue`` (a column or
    columns); rows with errors or out of memory are left out."""
    plt = _plt()
    data = df
    if "error" in data.columns:
        data = data[data["error"].fillna("") == ""]
    if "oom" in data.columns:
        data = data[data["oom"].fillna("") == ""]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    cols = [hue] if isinstance(hue, str) else list(hue or [])
    groups: Iterable = data.groupby(cols) if cols else [((), data)]
    for key, part in groups:
        part = part.sort_values(x)
        key = key if isinstance(key, tuple) else (key,)
        ax.plot(part[x], part[y], marker="o", label=" ".join(map(str, key)) or y)
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.grid(alpha=0.3)
    if cols:
        ax.legend(fontsize=8, title=" ".join(cols))
    ax.set_title(title or f"{y} vs {x}", fontsize=9)
    fig.tight_layout()
    return fig


def memory(result: SimResult, rank: int | None = None, title: str = "", hbm_bytes: int | None = None):
    """Allocated and reserved bytes over the step on one rank (default: the one with the
    highest reserved peak), allocator flushes as red dashes, the device's capacity dotted.
    Times are the host's: the caching allocator acts when the host allocates or frees,
    which runs ahead of the kernels."""
    plt = _plt()
    if rank is None:
        rank = max(result.ranks, key=lambda r: max((s[2] for s in result.ranks[r].memory_samples), default=0))
    rr = result.ranks[rank]
    fig, ax = plt.subplots(figsize=(10, 4))
    scale, unit = _scale(result.step_time_ns)
    samples = sorted(rr.memory_samples)
    if samples:
        t = [s[0] * scale for s in samples]
        ax.step(t, [s[1] / 2**30 for s in samples], where="post", label="allocated")
        ax.step(t, [s[2] / 2**30 for s in samples], where="post", label="reserved")
    for i, f in enumerate(rr.flush_times_ns):
        ax.axvline(f * scale, color="red", linewidth=0.8, linestyle="--", label="allocator flush" if i == 0 else None)
    if hbm_bytes:
        ax.axhline(hbm_bytes / 2**30, color="black", linewidth=0.8, linestyle=":", label="device memory")
    ax.set_xlim(0, result.step_time_ns * scale)
    ax.set_xlabel(f"host time ({unit})")
    ax.set_ylabel("GiB")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title or f"memory on rank {rank}", fontsize=9)
    fig.tight_layout()
    return fig
