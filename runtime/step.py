"""What a rank's step hands back, shared by its CPU and GPU behaviours.

A rank behaviour (``runtime.cpu_rank``, ``runtime.gpu_rank``) runs one step of the
rank's program and returns the host clock at its start and one ``TraceRecord`` per op
run, timed in nanoseconds on the host's monotonic clock (``time.perf_counter_ns``). Every
record is built by ``op_record`` (``rebased`` copies one into the step's own time base),
so a field added to ``TraceRecord`` is set in one place. An op that fails is named by
``ExecutionError``: the rank, the step and the op's text form.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

from commsim.ir import ops as O
from commsim.ir.trace import TraceRecord


class ExecutionError(RuntimeError):
    """A rank could not run an op: names the rank, the step and the op."""


class DataMismatch(ExecutionError):
    """A collective's result (``check_data``) is not what every rank's inputs make."""


def op_failure(rank: int, step: int, op: O.Op, text: str, err: BaseException) -> ExecutionError:
    """The error of ``op`` (``text``: its text form) failing with ``err``."""
    return ExecutionError(f"rank {rank}: step {step}: op {op.id} `{text}`: {type(err).__name__}: {err}")


def op_record(rank: int, stream: str, op: O.Op, start_ns: int, end_ns: int) -> TraceRecord:
    """The record of ``op`` having run on ``stream`` from ``start_ns`` to ``end_ns``."""
    dtype, group = O.collective_columns(op)
    return TraceRecord(rank, stream, int(op.id), O.op_kind_name(op), op.label, start_ns, end_ns,
                       O.op_size_bytes(op), O.op_flops(op), 0, op.phase.value, dtype, group)


def rebased(rec: TraceRecord, t0_ns: int, step: int) -> TraceRecord:
    """``rec`` with its times counted from ``t0_ns`` (the step's start), in measured
    step ``step``."""
    return replace(rec, start_ns=rec.start_ns - t0_ns, end_ns=rec.end_ns - t0_ns, step=step)


class RankStep(Protocol):
    """One rank's behaviour: allocates its program's setup, runs a step of it."""

    def setup(self) -> None:
        """Allocate the program's persistent buffers (before the first step)."""
        ...

    def run_step(self) -> tuple[int, list[TraceRecord]]:
        """(host clock at the step's start in ns, a record per op run)."""
        ...
