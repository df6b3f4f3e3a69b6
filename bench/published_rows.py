"""The rows of bench/validate_published.py and the plumbing its item families share.

A ``Row`` is one published figure beside its prediction (a ``Skipped`` one that commsim
cannot express, with the reason); the constants the items are written in (sizes, the
collective kinds, the two summary groups); the simulation helpers more than one family
uses: a hand-made program through the simulator in symmetric mode, one kernel on one GPU,
catalogue kernels one after the other, a model's config.json in a folder; and the output:
the table, each family's line and the two summary lines. Not a script: validate_published
and its parts (published_collectives, published_kernels, published_e2e) import it."""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from commsim.hardware.costs import SpecCostModel  # noqa: E402
from commsim.hardware.specs import ClusterSpec, cluster_preset  # noqa: E402
from commsim.ir import ops as O  # noqa: E402
from commsim.ir.schedule import Program, Schedule  # noqa: E402
from commsim.sim.engine import SimConfig, Simulator  # noqa: E402
from commsim.sim.records import OpRecord  # noqa: E402

KiB, MiB, GiB = 2**10, 2**20, 2**30
AR, AG, RS = O.CollectiveKind.ALL_REDUCE, O.CollectiveKind.ALL_GATHER, O.CollectiveKind.REDUCE_SCATTER
KC, E2E = "kernels+collectives", "end-to-end"


# ---------------------------------------------------------------- rows


@dataclass
class Row:
    item: str  # published-runs.md id: N1, G3, ...
    what: str  # which published number
    setup: str  # what was simulated
    unit: str
    published: float  # the midpoint when the published figure is a range
    predicted: float | None  # the midpoint when predicted over a range; None: nothing fits
    group: str  # KC or E2E
    published_range: tuple[float, float] | None = None
    predicted_range: tuple[float, float] | None = None
    note: str = ""
    sets: str = ""  # the constant this published figure set (SOURCES): calibration, not a check

    @property
    def error(self) -> float | None:
        if self.predicted is None:
            return None
        return (self.predicted - self.published) / self.published

    @property
    def in_range(self) -> bool | None:
        """With a predicted range: does the published figure lie inside it?"""
        if self.predicted_range is None:
            return None
        lo, hi = self.predicted_range
        return lo <= self.published <= hi

    def to_json(self) -> dict:
        out = asdict(self)
        out["error"] = self.error
        out["in_range"] = self.in_range
        return out


# The kernel and collective rows whose published figure a constant of commsim/hardware
# was computed from (each constant's comment cites the item): their small errors show the
# arithmetic, not the model, so the script also reports the other rows on their own.
_P3DN_SLOPE = "EFA_P3DN latency, 36 us (the slope of the three 8 B rows)"
_SOFTMAX = "SOFTMAX_BW_EFFICIENCY (the mean of the A100 and H100 rows)"
_CHANNELS = "NCCL's 2 channels per NIC (nccl.py)"
SOURCES: dict[tuple[str, str], str] = {
    ("G2", "cuBLASLt fp16 16384x16384x16384"): "the A100's gemm_max_efficiency, 256.5 / 312",
    ("G4", "V100 cuBLAS fp16 8192^3"): "the V100's gemm_max_efficiency, 97.4 / 125",
    ("G4", "V100 bf16 (emulated) matmul"): "the V100's bf16_gemm_flops_per_s, 10 TFLOPS",
    ("G3", "its dropout time"): "dropout_bw_efficiency, 0.72",
    ("M1", "A100-80GB STREAM triad"): "the A100's hbm_efficiency, 1.70 / 2.039",
    ("M1", "H100 STREAM triad"): "the H100's and H200's hbm_efficiency, 2.97 / 3.35",
    ("M2", "torch.nn.LayerNorm 2048x2048"): "norm_bw_efficiency, 715 / 1555",
    ("M3", "A100-80GB unfused attention, head dim 64"): _SOFTMAX,
    ("M3", "H100 unfused attention, head dim 128"): _SOFTMAX,
    ("N1", "all_reduce 8 B time"): "EFA_P4D latency, 20 us",
    ("N1", "all_reduce 1 GiB time"): "EFA_P4D message_ns, 14.5 us (from the 1 and 2 GiB rows)",
    ("N1", "all_reduce 2 GiB time"): "EFA_P4D message_ns, 14.5 us (from the 1 and 2 GiB rows)",
    ("N6", "p4d all_reduce 4 GiB busbw"): "EFA efficiency, 0.85",
    ("N8", "p3dn all_reduce 8 B 2 nodes time"): _P3DN_SLOPE,
    ("N8", "p3dn all_reduce 8 B 4 nodes time"): _P3DN_SLOPE,
    ("N8", "p3dn all_reduce 8 B 8 nodes time"): _P3DN_SLOPE,
    ("I2", "DGX A100 multi-node all_reduce busbw"): "InfiniBand efficiency, 0.96",
    ("X5", "SMs NCCL uses for one PCIe NIC"): _CHANNELS,
    ("X5", "SMs NCCL uses for 8 NICs at 190 GB/s"): _CHANNELS,
}


def mark_sources(rows: list[Row], items: set[str]) -> None:
    """Set each source row's ``sets``; every source of the ``items`` run must be there
    (a renamed row would otherwise count as a check)."""
    have = {(r.item, r.what): r for r in rows}
    for key, what in SOURCES.items():
        if key[0] in items:
            assert key in have, f"SOURCES names a row the items did not produce: {key}"
            have[key].sets = what


@dataclass(frozen=True)
class Skipped:
    item: str
    what: str
    reason: str


def range_row(item: str, what: str, setup: str, unit: str, published: float, values: list[float], group: str,
              note: str = "") -> Row:
    """A row predicted over an unpublished setting: its midpoint compared, its range shown."""
    if not values:
        return Row(item, what, setup, unit, published, None, group, note=note or "every point ran out of memory")
    lo, hi = min(values), max(values)
    return Row(item, what, setup, unit, published, (lo + hi) / 2, group, predicted_range=(lo, hi), note=note)


# ---------------------------------------------------------------- simulating one-op schedules


def run_ops(cluster: ClusterSpec, ops: list[O.Op], precision: str = "bf16") -> dict[int, OpRecord]:
    """Simulate a hand-made program run by every rank of ``cluster`` (symmetric mode);
    rank 0's record of each op, by op id."""
    cost = SpecCostModel(cluster, precision)
    schedule = Schedule.uniform(cluster.world_size, Program((), tuple(ops)))
    result = Simulator(schedule, cost, SimConfig(mode="symmetric")).run()
    assert result.oom is None, result.oom
    return {int(r.op.id): r for r in result.ranks[0].records}


def duration_ns(rec: OpRecord) -> int:
    return rec.end_ns - rec.start_ns


# ---------------------------------------------------------------- kernels on one GPU


def one_gpu(preset: str) -> ClusterSpec:
    return cluster_preset(preset, 1, gpus_per_node=1)


def gemm_op(g: O.GemmShape, op_id: int = 1, dtype_bytes: int = 2, label: str = "gemm") -> O.Compute:
    """A (batched) GEMM reading A and B once and writing C once."""
    b = g.batch
    return O.Compute(O.OpId(op_id), "compute", label, O.ComputeKind.GEMM, g.flops,
                     (g.m * g.k + g.k * g.n) * b * dtype_bytes, g.m * g.n * b * dtype_bytes, g)


def kernel_op(k, op_id: int = 1) -> O.Compute:
    """A catalogue Kernel as a Compute op on the compute stream."""
    return O.Compute(O.OpId(op_id), "compute", k.name, k.kind, k.flops, k.bytes_read, k.bytes_written, k.gemm)


def shape_name(g: O.GemmShape) -> str:
    s = f"{g.m}x{g.n}x{g.k}"
    return s if g.batch == 1 else f"{g.batch}x({s})"


def kernel_time_ns(preset: str, op: O.Compute | O.Copy, precision: str = "bf16") -> int:
    return duration_ns(run_ops(one_gpu(preset), [op], precision)[1])


def first(kernels, kind: O.ComputeKind, name: str | None = None):
    """The first kernel of ``kind`` (named ``name``) in a module's list."""
    return next(k for k in kernels if k.kind is kind and (name is None or k.name == name))


def chain_time_ns(cluster: ClusterSpec, kernels, precision: str) -> int:
    """Catalogue kernels one after the other on the compute stream: first start to last end."""
    ops = [replace(kernel_op(k, i + 1), deps=(O.OpId(i),) if i else ()) for i, k in enumerate(kernels)]
    recs = run_ops(cluster, ops, precision)
    return max(r.end_ns for r in recs.values()) - min(r.start_ns for r in recs.values())


# ---------------------------------------------------------------- a model's config.json


def write_config(folder: Path, name: str, cfg: dict) -> str:
    path = folder / name / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg))
    return str(path)


# ---------------------------------------------------------------- output


def fmt(v: float | None) -> str:
    if v is None:
        return "-"
    a = abs(v)
    if a == 0:
        return "0"
    if a >= 1000:
        return f"{v:.0f}"
    if a >= 100:
        return f"{v:.1f}"
    if a >= 1:
        return f"{v:.2f}"
    return f"{v:.3g}"


def summary(rows: list[Row], group: str) -> dict:
    errs = [abs(r.error) for r in rows if r.group == group and r.error is not None]
    return {"summary": group, "median_abs_error": statistics.median(errs) if errs else None,
            "max_abs_error": max(errs) if errs else None, "items": len(errs)}


def checks_only(rows: list[Row]) -> dict:
    """The kernel and collective rows that set no constant: the figures that test the model."""
    s = summary([r for r in rows if not r.sets], KC)
    return {"checks_only": KC, "median_abs_error": s["median_abs_error"], "max_abs_error": s["max_abs_error"],
            "items": s["items"], "sources": sum(1 for r in rows if r.sets and r.group == KC)}


def checks_only_line(c: dict) -> str:
    def pct(v: float | None) -> str:
        return "n/a" if v is None else f"{100 * v:.1f}%"
    return (f"{c['sources']} {c['checks_only']} rows set a constant ([sets: ...]); the other "
            f"{c['items']}: median |error| = {pct(c['median_abs_error'])}  max |error| = {pct(c['max_abs_error'])}")


def summary_line(s: dict) -> str:
    def pct(v: float | None) -> str:
        return "n/a" if v is None else f"{100 * v:.1f}%"
    return (f"{s['summary']}: median |error| = {pct(s['median_abs_error'])}  "
            f"max |error| = {pct(s['max_abs_error'])}  items = {s['items']}")


def family(item: str) -> str:
    """The README's grouping of items: collectives over EFA (N), NVSwitch / InfiniBand (I),
    GEMMs and layers (G), memory-bound kernels (M), interference (X); each end-to-end item
    on its own."""
    return item if item.startswith("E") else item[0]


def family_summaries(rows: list[Row]) -> list[dict]:
    """Median and max |error| of each family's rows, in the order the rows came."""
    out: dict[str, list[float]] = {}
    for r in rows:
        if r.error is not None:
            out.setdefault(family(r.item), []).append(abs(r.error))
    return [{"family": f, "median_abs_error": statistics.median(e), "max_abs_error": max(e), "items": len(e)}
            for f, e in out.items()]


def print_families(fams: list[dict]) -> None:
    print("by family (|error| of each row; a range row compares the middle of its range):")
    for f in fams:
        print(f"  {f['family']:<3} rows {f['items']:>4}  median {100 * f['median_abs_error']:5.1f}%  "
              f"max {100 * f['max_abs_error']:6.1f}%")
    print()


def print_table(rows: list[Row], skipped: list[Skipped]) -> None:
    head = f"{'item':<4} {'what':<46} {'published':>14} {'predicted':>24} {'error':>8}  {'unit':<10} setup"
    print(head)
    print("-" * len(head))
    for r in rows:
        pub = fmt(r.published)
        if r.published_range is not None:
            pub += f" ({fmt(r.published_range[0])}-{fmt(r.published_range[1])})"
        if r.predicted_range is not None:
            inside = "in" if r.in_range else "out"
            pred = f"{fmt(r.predicted)} ({fmt(r.predicted_range[0])}-{fmt(r.predicted_range[1])} {inside})"
        else:
            pred = fmt(r.predicted)
        err = "-" if r.error is None else f"{100 * r.error:+.1f}%"
        print(f"{r.item:<4} {r.what:<46} {pub:>14} {pred:>24} {err:>8}  {r.unit:<10} {r.setup}"
              + (f"  [{r.note}]" if r.note else "") + (f"  [sets: {r.sets}]" if r.sets else ""))
    if skipped:
        print("\nskipped (not expressible today):")
        for s in skipped:
            print(f"  {s.item:<4} {s.what}: {s.reason}")
    print()
