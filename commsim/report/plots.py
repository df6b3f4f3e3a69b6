"""Plots: a timeline of one simulated or measured step (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path

from commsim.ir import ops as O
from commsim.sim.engine import HOST, SimResult

COLOURS = {
    "gemm": "#4c72b0", "attention": "#55a868", "elementwise": "#8172b2", "optimizer": "#937860",
    "embedding": "#64b5cd", "all_gather": "#dd8452", "reduce_scatter": "#c44e52", "all_reduce": "#da8bc3",
    "broadcast": "#ccb974", "copy": "#8c8c8c", "host": "#bbbbbb",
}


def _colour(op: O.Op) -> str:
    if isinstance(op, (O.Compute, O.Collective)):
        return COLOURS.get(op.kind.value, "#999999")
    if isinstance(op, O.Copy):
        return COLOURS["copy"]
    return COLOURS["host"]


def timeline_png(result: SimResult, path: str | Path, title: str = "", max_ranks: int = 4) -> None:
    """Per rank and stream, ops as bars coloured by kind; host blocks hatched; flushes marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    from commsim.util.files import atomic_write_bytes

    ranks = sorted(result.ranks)[:max_ranks]
    rows: list[tuple[int, str]] = []
    for r in ranks:
        streams = sorted({rec.stream for rec in result.ranks[r].records if rec.stream != HOST})
        rows.extend((r, s) for s in streams)
        rows.append((r, HOST))
    index = {row: i for i, row in enumerate(rows)}
    fig, ax = plt.subplots(figsize=(14, 0.45 * len(rows) + 1.6))
    scale = 1e-3 if result.step_time_ns < 5e8 else 1e-9
    unit = "us" if scale == 1e-3 else "s"
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
        hy = index[(r, HOST)]
        blocked = [(hb.start_ns * scale, (hb.end_ns - hb.start_ns) * scale) for hb in rr.host_blocks]
        if blocked:
            ax.broken_barh(blocked, (hy - 0.4, 0.8), facecolors="none", edgecolor="#444444", hatch="///",
                           linewidth=0.3)
        for t in rr.flush_times_ns:
            ax.axvline(t * scale, color="red", linewidth=0.8, linestyle="--")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {r} {s}" for r, s in rows])
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(title or "step timeline", fontsize=9)
    legend = [Patch(color=c, label=k) for k, c in COLOURS.items()]
    legend.append(Patch(facecolor="none", edgecolor="#444444", hatch="///", label="host blocked"))
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=7, fontsize=7)
    fig.tight_layout()
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
