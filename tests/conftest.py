"""Shared fixtures; tool caches kept inside the work tree."""

import os
import shutil
from pathlib import Path
from typing import Callable

import pytest

os.environ.setdefault("MPLBACKEND", "Agg")

from commsim.ir import ops as O  # noqa: E402
from commsim.ir.schedule import Program, Schedule, ScheduleMeta  # noqa: E402


@pytest.fixture(scope="session")
def made_once(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, Callable[[Path], None]], Path]:
    """``made_once(name, make)``: a folder that ``make`` fills once per test session, even
    when pytest-xdist's workers each run the module that needs it (a module-scoped
    fixture runs once per worker, and a real multi-rank run made twice costs the suite
    its time twice). The first worker to ask makes it under a file lock; the others wait
    for it and read the same files."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the session's, shared by its workers

    def made(name: str, make: Callable[[Path], None]) -> Path:
        folder, done = root / name, root / f"{name}.done"
        with FileLock(str(root / f"{name}.lock")):
            if not done.exists():
                shutil.rmtree(folder, ignore_errors=True)
                folder.mkdir()
                make(folder)
                done.touch()
        return folder

    return made


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
