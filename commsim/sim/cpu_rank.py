"""A CPU rank (gloo): kernels on the host thread, collectives in program order.

A CPU has no device queue: a compute or copy op runs on the host thread when the host
reaches it, once the previous op of its stream and its deps are done. Collectives run
in the backend's threads; gloo matches a group's collectives by the order of their
calls, so they reach the backend in the order the host issued them (a ticket each),
whatever stream they are on. On a node whose ranks outnumber its cores, the host thread
runs its kernels on a time-sliced core (``cpu_scheduler``) and the cores are shared
instead of kernels being slowed by a factor; otherwise kernels run slower while a
collective is in flight, and slow the node's links while they run. A collective's call
can hold the host thread (gloo's reduce-scatter works on the caller's thread): the host
pays that measured time before its next op. A collective after which its rank computes
(rather than issuing another collective) takes its measured stall on top
(``followed_by_compute``; ``CollectivePlan.stall_ns``).

gloo's all-gather and reduce-scatter on one tensor work on a temporary of the whole
buffer (torch 2.13: ``_reduce_scatter_base_`` clones its input on the caller's thread
and all-reduces the clone; the all-gather writes a temporary of the output; measured:
one call's fresh pages equal the buffer). At glibc's mmap ceiling and above it is
mapped and unmapped around each call, so on a VM that reports free memory it takes the
rank's returned pages like any large block (``RankMemory._reported_ns``) and gives them
back when the collective ends. The calibrated collective already pays fresh pages (its
back-to-back calls reuse pages returned a moment before, never reported): only the
reported share's extra is added, on the caller's thread for the reduce-scatter's clone.
"""

from __future__ import annotations

import simpy

from commsim.hardware.profile import GLIBC_MMAP_THRESHOLD_MAX_BYTES
from commsim.ir import ops as O
from commsim.ir.schedule import Program
from commsim.sim.rank import RankSim
from commsim.sim.records import OpRecord

# the collectives whose gloo call works on a temporary of the whole buffer (size_bytes)
GLOO_TEMPORARY = (O.CollectiveKind.ALL_GATHER, O.CollectiveKind.REDUCE_SCATTER)


def followed_by_compute(program: Program) -> frozenset[O.OpId]:
    """The step's collectives whose rank next runs a kernel or a copy (the first device
    op after it in program order is a compute or copy op), not another collective: a
    layer's gather before its GEMMs, a gradient's reduce-scatter amid backward; not the
    optimizer's back-to-back re-gathers of persistent parameters. Host ops, allocations
    and synchronisations in between do not count: they are short. Training repeats the
    step, so the step's last collective is followed by the next step's first device op
    (the forward's first kernel, or a collective)."""
    out: set[O.OpId] = set()
    pending: list[O.OpId] = []  # collectives not yet followed by a device op
    first_device: O.Op | None = None
    for op in program.step:
        if isinstance(op, O.Collective):
            pending.clear()  # followed by a collective
            pending.append(op.id)
        elif isinstance(op, (O.Compute, O.Copy)):
            out.update(pending)
            pending.clear()
        if first_device is None and isinstance(op, (O.Collective, O.Compute, O.Copy)):
            first_device = op
    if isinstance(first_device, (O.Compute, O.Copy)):
        out.update(pending)  # wraps around into the next step
    return frozenset(out)


class CpuRank(RankSim):
    def __init__(self, sim, rank: int):
        super().__init__(sim, rank)
        # program-order issue: tickets handed out by the host, served in order
        self.tickets_given = 0
        self.tickets_served = 0
        self.ticket_waiters: dict[int, simpy.Event] = {}

    def issue_device(self, op: O.DeviceOp):
        if isinstance(op, O.Collective):
            ticket = self.tickets_given
            self.tickets_given += 1
            yield from self._enqueue(op, ticket)
        else:
            yield from self._run_on_host(op)

    def kernel(self, op: O.Compute | O.Copy):
        # A copy is the rank's thread at work too, like a kernel. On time-sliced cores
        # the cores are shared instead of kernels being slowed by a factor.
        if isinstance(op, O.Compute):
            dur = self._compute_ns(op, comm_slowed=self.cpu is None)
        else:
            dur = self._speed(self.cost.copy_ns(op))
        if self.cpu is not None:
            yield from self._on_core(dur)
        else:
            yield from self._timed_on_node(dur)

    def _run_on_host(self, op: O.Compute | O.Copy):
        """The kernel runs on the host thread once its inputs are ready."""
        env = self.env
        issued = env.now
        prev = self.last_issued.get(op.stream)  # stream order: after the stream's previous op
        yield from self._host_waits(op.deps + ((self._last_id[op.stream],) if prev is not None else ()))
        start = env.now
        yield from self.kernel(op)
        self.python_after_ns = self.cost.python_after_kernel_ns(op)  # the host's next Python runs cold
        done = env.event()
        self.done[op.id] = done
        self._issued(op, done)
        r = OpRecord(self.rank, op.stream, op, issued, start, env.now, 0, None, start)
        self.record_of[op.id] = r
        if self.sim.config.keep_trace:
            self.result.records.append(r)
        done.succeed(op.id)

    def _collective(self, op: O.Collective, seq: int):
        # The backend's call holds the calling (host) thread for a measured time while
        # the collective runs (gloo's reduce-scatter, say); the host pays it before its
        # next op. The collective's own time, measured from the call, already includes it.
        call_ns = self.cost.collective(op).call_ns
        if call_ns:
            self.host_debt_ns += self._speed(call_ns)
        temp = op.size_bytes if (op.kind in GLOO_TEMPORARY and op.size_bytes >= GLIBC_MMAP_THRESHOLD_MAX_BYTES) else 0
        if temp:
            extra = self._take_returned(temp, op.phase) if self.returned is not None else 0
            if extra:
                extra = self._speed(extra)  # (the rank's speed draws only for time it spends)
                if op.kind is O.CollectiveKind.REDUCE_SCATTER:
                    self.host_debt_ns += extra  # the clone holds the caller
                yield self.env.timeout(extra)  # the rank's part waits for its temporary's writes
            fresh = self.result.fresh_page_bytes
            fresh[op.phase.value] = fresh.get(op.phase.value, 0) + temp
        out = yield from super()._collective(op, seq)
        if temp and self.returned is not None:
            self.returned.returned(self.env.now, temp)  # unmapped at the call's end
        return out

    def await_ticket(self, ticket: int):
        """A collective goes to the backend only after every collective the host issued
        before it (on any stream) went: gloo matches a group's collectives by the order
        of their calls, so the executor hands them over in program order (and a
        framework's single Python thread calls them so), and a collective whose inputs
        are ready waits while an earlier one waits for its own."""
        if self.tickets_served != ticket:
            ev = self.ticket_waiters[ticket] = self.env.event()
            yield ev
        assert self.tickets_served == ticket
        self.tickets_served += 1
        nxt = self.ticket_waiters.pop(self.tickets_served, None)
        if nxt is not None:
            nxt.succeed()
