"""bench/fresh_memory_ab.py: a framework row with and without fresh memory."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import fresh_memory_ab as fm  # noqa: E402

# a child that frees a 64 MiB block and takes it again, printing the faults of the second
# write: mmapped (fresh pages) by default, from the kept heap with the tunables
CHILD = """
import resource
def faults(): return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
b = bytearray(64 << 20); del b
f = faults(); b = bytearray(64 << 20); print(faults() - f)
"""


def _second_write_faults(tunables: str | None) -> int:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    if tunables is not None:
        env["GLIBC_TUNABLES"] = tunables
    return int(subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True,
                              check=True).stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's tunables")
def test_the_tunables_keep_a_freed_block_from_faulting_again():
    assert _second_write_faults(None) > (48 << 20) // resource.getpagesize()  # fresh pages again
    assert _second_write_faults(fm.NO_FRESH_MEMORY) < 1000  # the heap's own


def test_a_runs_summary_skips_the_warm_up():
    pages_a_mib = (1 << 20) // resource.getpagesize()
    timings = {"phase_times_s": {"forward": [5, 5, 0.1, 0.3, 0.2]},
               "phase_minor_faults": {"forward": [0, 0, pages_a_mib, 2 * pages_a_mib, 3 * pages_a_mib]}}
    r = fm.run_summary(2.0, timings, 2)
    assert r == {"step_ms": 2000.0, "phases_ms": {"forward": 200.0}, "faults_mib": {"forward": 2.0}}


def test_the_difference_is_of_the_medians_over_runs():
    line = fm.difference_line([{"step_ms": 1000.0}, {"step_ms": 1100.0}], [{"step_ms": 800.0}, {"step_ms": 900.0}])
    assert line == ("fresh memory: +200.0 ms a step (+19.0%): median step 1050.0 ms as it is, "
                    "850.0 ms without fresh memory (2 + 2 runs)")


def test_only_framework_rows():
    assert fm.framework_row("FSDP2 small").runner == "fsdp2"
    with pytest.raises(ValueError, match="'small z2': not a DeepSpeed or FSDP2 row of the grid; rows: DS small z3"):
        fm.framework_row("small z2")
    out = subprocess.run([sys.executable, str(Path(fm.__file__)), "--row", "small z2"], capture_output=True, text=True)
    assert out.returncode == 2 and "--row 'small z2': not a DeepSpeed or FSDP2 row" in out.stderr
