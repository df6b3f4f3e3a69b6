"""A GPU rank: kernels queued on streams, the host running ahead, the device shared.

Every device op (compute, copy, collective) is queued on its stream; the stream runs it
once the stream's previous op and its deps are done. A kernel shares the GPU with the
rank's in-flight collectives: their CTAs hold SMs and their traffic takes HBM bandwidth
(``hardware.sharing``), so its time is priced beside what they take, and re-priced for
the rest of its work whenever a collective starts or ends while it runs. Its own claim
on HBM (the bytes/s it moves alone), in turn, leaves less for the collectives (the
engine's HBM links), each side getting at least its proportional share. A cost model
without GPU resources (a measured profile) prices the slowdown by its measured factor.
Copies run for their time.
"""

from __future__ import annotations

import simpy

from commsim.hardware.sharing import IDLE
from commsim.ir import ops as O
from commsim.sim.rank import RankSim


class GpuRank(RankSim):
    # every device op is queued on its stream (bound directly: this runs once per op)
    issue_device = RankSim._enqueue

    def __init__(self, sim, rank: int):
        super().__init__(sim, rank)
        self.running: set[simpy.Process] = set()  # stream processes inside a kernel now
        self.shared = sim.cost.gpu_resources is not None

    def kernel(self, op: O.Compute | O.Copy):
        env = self.env
        if not isinstance(op, O.Compute):
            yield env.timeout(self._speed(self.cost.copy_ns(op)))
            return
        base = self.cost.compute_ns(op, self.taken)
        dur = self._jittered(base)
        self.sim.compute_started(self.node)
        if not self.shared:
            yield env.timeout(dur)
            self.sim.compute_ended(self.node)
            return
        scale = dur / base  # the rank's jitter and speed, kept when the kernel is re-priced
        # the HBM bytes/s it moves when it runs alone: its claim on HBM beside collectives
        alone = base if not self.taken else self.cost.compute_ns(op, IDLE)
        rate = self.cost.kernel_hbm_bytes(op) / (alone * scale / 1e9)
        self.sim.kernel_hbm_changed(self.rank, rate)
        me = env.active_process
        self.running.add(me)
        left = 1.0  # the fraction of the kernel's work still to do
        while True:
            t0 = env.now
            try:
                yield env.timeout(dur if left == 1.0 else max(0, round(left * dur)))
                break
            except simpy.Interrupt:  # the collectives beside it changed: re-price the rest
                left = max(0.0, left - (env.now - t0) / dur)
                dur = max(1, int(self.cost.compute_ns(op, self.taken) * scale))
        self.running.discard(me)
        self.sim.kernel_hbm_changed(self.rank, -rate)
        self.sim.compute_ended(self.node)

    def comm_began(self, sms: int, hbm_rate: float) -> None:
        super().comm_began(sms, hbm_rate)
        self._reprice()

    def comm_ended(self, sms: int, hbm_rate: float) -> None:
        super().comm_ended(sms, hbm_rate)
        self._reprice()

    def _reprice(self) -> None:
        """Kernels running now get their rest priced beside what the collectives take."""
        if self.shared:
            for proc in self.running:
                proc.interrupt()
