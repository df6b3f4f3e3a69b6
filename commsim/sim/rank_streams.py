"""A simulated rank's streams: device ops queued in issue order and run once their deps
are done. The host queues an op on its stream (``_enqueue``), blocking while the stream
already holds ``SimConfig.launch_queue_depth`` pending ops (CUDA's bounded launch
queue); each stream's process then runs its ops in order: a kernel or copy for its
platform's time (``RankSim.kernel``), a collective when every simulated member of its
group has reached the same call of that group (matched in issue order, NCCL's launch
order), holding its CTAs and HBM traffic while it runs (``comm_began`` /
``comm_ended``, which the kernels beside it are priced under). A mixin of
``rank.RankSim``, whose state it uses."""

from __future__ import annotations

from collections import deque

import simpy

from commsim.ir import ops as O
from commsim.sim.records import HostBlock, OpRecord


class RankStreams:
    """Queueing and running one rank's device ops; the attributes it reads are RankSim's."""

    def _enqueue(self, op: O.DeviceOp, ticket: int | None = None):
        """Queue a device op on its stream; the host blocks while the stream already holds
        ``launch_queue_depth`` pending ops (CUDA's bounded launch queue)."""
        env = self.env
        t0 = env.now
        stream = op.stream
        q = self.queues.get(stream)
        if q is None:
            self._start_stream(stream)
            q = self.queues[stream]
        while len(q) >= self.sim.config.launch_queue_depth:
            ev = env.event()
            self.space[stream] = ev
            yield ev
            if self.lateness is not None:
                self.lateness.waited()
        if env.now > t0:
            self.result.host_blocks.append(HostBlock(t0, env.now, "launch_queue"))
        done = env.event()
        self.done[op.id] = done
        self._issued(op, done)
        seq, late = None, 0
        if isinstance(op, O.Collective):
            # a group's collectives match across ranks in the order the host issued them
            # (the IR's rule, NCCL's launch order), whatever streams they wait on
            seq = self.coll_seq.get(op.group, 0)
            self.coll_seq[op.group] = seq + 1
            if self.lateness is not None:
                late = self.lateness.slowest_of(len(op.group))
        q.append((op, env.now, ticket, seq, late))
        w = self.wakeups.get(stream)
        if w is not None:
            self.wakeups[stream] = None
            w.succeed()

    def _issued(self, op: O.DeviceOp, done: simpy.Event) -> None:
        """``op`` is now its stream's last: later syncs and frees wait for ``done``."""
        self.last_issued[op.stream] = done
        self._last_id[op.stream] = op.id
        for b in op.buffers:
            bs = self.buffer_streams.get(b)
            if bs is not None:
                bs.add(op.stream)


    def _start_stream(self, stream: str) -> None:
        self.queues[stream] = deque()
        self.wakeups[stream] = None
        self.space[stream] = None
        self.env.process(self.stream_proc(stream))

    def stream_proc(self, stream: str):
        env, q = self.env, self.queues[stream]
        rec = self.sim.config.keep_trace
        while True:
            if not q:
                if self.finished_issuing:
                    return
                ev = env.event()
                self.wakeups[stream] = ev
                yield ev
                continue
            op, issued, ticket, seq, late = q.popleft()
            sp = self.space.get(stream)
            if sp is not None:
                self.space[stream] = None
                sp.succeed()
            last_dep = None
            for d in op.deps:
                e = self.done[d]
                if not e.processed:
                    yield e
                    last_dep = d
            ready = env.now
            wait_peers = 0
            if isinstance(op, O.Collective):
                if ticket is not None:
                    yield from self.await_ticket(ticket)
                late_wait = issued + late - env.now  # the slowest member issues it later
                if late_wait > 0:
                    yield env.timeout(late_wait)
                start, wait_peers = yield from self._collective(op, seq)
                wait_peers += max(0, late_wait)
            else:
                start = env.now
                yield from self.kernel(op)
            r = OpRecord(self.rank, stream, op, issued, start, env.now, wait_peers, last_dep, ready)
            self.record_of[op.id] = r
            if rec:
                self.result.records.append(r)
            self.done[op.id].succeed(op.id)

    def await_ticket(self, ticket: int):
        """A collective's turn to reach the backend (program-order platforms). A generator."""
        raise NotImplementedError

    def _collective(self, op: O.Collective, seq: int):
        """Arrive at the ``seq``-th collective of the op's group (counted in issue order);
        returns (start, time waited for peers)."""
        env, sim = self.env, self.sim
        rv = sim.arrive(op, seq, self.rank)
        arrived = env.now
        yield rv.event
        start = rv.event.value
        self.comm_began(rv.sms, rv.hbm_rate)
        yield rv.done
        self.comm_ended(rv.sms, rv.hbm_rate)
        return start, start - arrived

    def comm_began(self, sms: int, hbm_rate: float) -> None:
        """A collective of this rank started: its CTAs and HBM traffic are now taken."""
        self.taken = self.taken.plus(sms, hbm_rate)
        self.comm_since_python, self.comm_running = True, self.comm_running + 1

    def comm_ended(self, sms: int, hbm_rate: float) -> None:
        self.taken = self.taken.minus(sms, hbm_rate)
        self.comm_running -= 1
