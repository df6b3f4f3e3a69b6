"""A framework's memory-bound kernels priced by class and dtype, as calibrate measured
them (pure; the profile's ``framework_kernels`` table, written by
``runtime.calibrate_classes``).

The executor runs every memory-bound op as one stand-in kernel over the op's bytes, and
``HardwareProfile.elementwise_points`` price that. A framework's run launches the real
ATen kernel of each op's ``ComputeKind`` (LayerNorm, softmax, dropout, a row
reduction, an embedding lookup, an element-wise add), whose time per byte on a CPU
depends on the class, on forward or backward, and on the dtype. A profile priced for a
framework's run (``HardwareProfile.run_by_framework``) takes a memory-bound op's time
from the table of its class, direction and dtype: linear between the measured sizes,
extended by the last segment beyond them, less the smallest size's time (a call's fixed
part: the schedule's launch host op prices the dispatch, as with ``elementwise_points``).

Which dtype: the step's precision (the activations', as the schedule says), except in
the optimizer phase, whose ops work on fp32 master weights, gradients and state in
every mixed-precision recipe DeepSpeed and FSDP2 run. Which direction: an op of the
backward phase runs the class's backward kernel, every other phase its forward.
Classes the table lacks (GEMMs, attention, the optimizer's fused passes) and ops of a
dtype it lacks are priced as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from commsim.hardware.profile import piecewise
from commsim.ir import ops as O
from commsim.ir.errors import CommsimInputError

KINDS = {k.value: k for k in (O.ComputeKind.ELEMENTWISE, O.ComputeKind.REDUCTION, O.ComputeKind.NORM,
                              O.ComputeKind.SOFTMAX, O.ComputeKind.DROPOUT, O.ComputeKind.EMBEDDING)}
DIRECTIONS = ("fwd", "bwd")
Points = tuple[tuple[float, float], ...]


@dataclass(frozen=True)
class FrameworkKernels:
    """(dtype, kind, direction) -> measured (bytes, seconds), ascending bytes."""

    tables: dict[tuple[str, O.ComputeKind, str], Points]
    source: str = ""

    def kernel_s(self, op: O.Compute, precision: str) -> float | None:
        """Seconds of ``op``'s kernel in a framework's run of a ``precision`` step; None
        where the table has no class, direction or dtype for it."""
        dtype = "fp32" if op.phase is O.Phase.OPTIMIZER else {"fp16": "bf16"}.get(precision, precision)
        pts = self.tables.get((dtype, op.kind, "bwd" if op.phase is O.Phase.BACKWARD else "fwd"))
        if pts is None:
            return None
        return max(0.0, piecewise(pts, float(op.bytes_read + op.bytes_written)) - pts[0][1])


def framework_kernels_from_dict(obj: Any, where: str) -> FrameworkKernels | None:
    """The profile's ``framework_kernels`` object (None when absent): dtype -> kind ->
    {"fwd": [[bytes, seconds], ...], "bwd": [...]}, at least two sizes each, and an
    optional ``source`` line."""
    if obj is None:
        return None
    field = f"{where}: field 'framework_kernels'"
    if not isinstance(obj, dict):
        raise CommsimInputError(f"{field} must be an object of dtype -> kind -> {{fwd, bwd}} points")
    tables: dict[tuple[str, O.ComputeKind, str], Points] = {}
    for dtype, by_kind in obj.items():
        if dtype == "source":
            continue
        if dtype not in ("fp32", "bf16") or not isinstance(by_kind, dict):
            raise CommsimInputError(f"{field}: '{dtype}' must be fp32 or bf16, mapping kinds to {{fwd, bwd}} points")
        for kind, dirs in by_kind.items():
            if kind not in KINDS or not isinstance(dirs, dict):
                raise CommsimInputError(f"{field}.{dtype}: kind '{kind}' must be one of {', '.join(KINDS)}, "
                                        "mapping fwd / bwd to points")
            for d, pts in dirs.items():
                ok = d in DIRECTIONS and isinstance(pts, list) and len(pts) >= 2 and all(
                    isinstance(p, list) and len(p) == 2 and all(isinstance(v, (int, float)) and v > 0 for v in p)
                    for p in pts)
                if not ok:
                    raise CommsimInputError(f"{field}.{dtype}.{kind}.{d}: must be fwd or bwd with at least two "
                                            "[bytes, seconds] points, both > 0")
                srt = tuple(sorted((float(x), float(y)) for x, y in pts))
                if len({x for x, _ in srt}) != len(srt):
                    raise CommsimInputError(f"{field}.{dtype}.{kind}.{d}: two points of the same size")
                tables[(dtype, KINDS[kind], d)] = srt
    src = obj.get("source", "")
    return FrameworkKernels(tables, src if isinstance(src, str) else "")
