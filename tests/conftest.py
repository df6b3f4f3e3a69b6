"""Shared fixtures; tool caches kept inside the work tree."""

import os

import pytest

os.environ.setdefault("MPLBACKEND", "Agg")

from commsim.ir import ops as O  # noqa: E402
from commsim.ir.schedule import Program, Schedule, ScheduleMeta  # noqa: E402


@pytest.fixture
def tiny_schedule() -> Schedule:
    p = Program(
        setup=(O.Alloc(O.OpId(0), "compute", "init w", "w", 4096),),
        step=(
            O.Collective(O.OpId(1), "allgather", 'fetch "w"', O.CollectiveKind.ALL_GATHER, 8192, O.DType.BF16,
                         (0, 1), buffers=("w",)),
            O.Compute(O.OpId(2), "compute", "fwd", O.ComputeKind.GEMM, 1024, 10, 10, O.GemmShape(8, 8, 8),
                      deps=(O.OpId(1),), buffers=("w",)),
            O.HostSync(O.OpId(3), "sync", O.SyncScope.DEVICE),
        ),
    )
    return Schedule.uniform(2, p, ScheduleMeta(model="tiny", knobs=(("a", True),)))
