"""A GPU rank: kernels queued on streams, the host running ahead.

Every device op (compute, copy, collective) is queued on its stream; the stream runs it
once the stream's previous op and its deps are done. A kernel runs slower while its
rank has a collective in flight (NCCL's channels take SMs), and slows the node's links
while it runs when the cost model says so; copies run for their time.
"""

from __future__ import annotations

from commsim.ir import ops as O
from commsim.sim.rank import RankSim


class GpuRank(RankSim):
    # every device op is queued on its stream (bound directly: this runs once per op)
    issue_device = RankSim._enqueue

    def kernel(self, op: O.Compute | O.Copy):
        if isinstance(op, O.Compute):
            dur = self._compute_ns(op, comm_slowed=True)
            self.sim.compute_started(self.node)
            yield self.env.timeout(dur)
            self.sim.compute_ended(self.node)
        else:
            yield self.env.timeout(self._speed(self.cost.copy_ns(op)))
