"""A cost model with round numbers for exact-trace tests: 1 flop = 1 ns, 1 byte = 1 ns."""

from commsim.hardware.links import CollectivePlan, Link, LinkKind
from commsim.hardware.platform import GPU
from commsim.hardware.sharing import IDLE
from commsim.ir import ops as O


class FixedCosts:
    platform = GPU
    gpu_resources = None  # interference by factors (comm_slowdown): none unless a test sets one
    comm_slowdown = 1.0
    comm_slowdown_during_compute = 1.0
    comm_latency_slowdown_during_compute = 1.0
    issue_ns = 0
    malloc_base_ns = 1000
    malloc_ns_per_byte = 0.0
    free_base_ns = 500
    free_ns_per_byte = 0.0
    describe = "fixed"
    reported = None
    unmap_ns_per_byte = 0.0
    loop_ns: dict = {}
    after_kernel_ns = 0

    def __init__(self, hbm_bytes: int = 1 << 40, gpus_per_node: int = 1, link_bytes_per_s: float = 1e9,
                 latency_ns: int = 0):
        self.hbm_bytes = hbm_bytes
        self.gpus_per_node = self.ranks_per_node = gpus_per_node
        self.bw = link_bytes_per_s
        self.latency_ns = latency_ns

    def compute_ns(self, op, taken=IDLE):
        return int(op.flops * self.comm_slowdown) if taken else op.flops

    def kernel_hbm_bytes(self, op):
        return float(op.bytes_read + op.bytes_written)

    def copy_ns(self, op):
        return op.size_bytes

    def host_malloc_ns(self, size_bytes, touch_bytes=None):
        return self.malloc_base_ns + int(self.malloc_ns_per_byte * (size_bytes if touch_bytes is None else touch_bytes))

    def fresh_page_ns_per_byte(self):
        return None

    def reported_pages(self):
        return self.reported  # (period ns, extra ns a byte) a test sets, else None

    def python_after_kernel_ns(self, op):
        return self.after_kernel_ns  # 0 unless a test sets it

    def host_op_ns(self):
        return dict(self.loop_ns)  # the executor's loop per host op, if a test sets it

    def host_unmap_ns(self, nbytes):
        return int(self.unmap_ns_per_byte * nbytes)  # 0 unless a test sets it

    def framework_python_ns(self, duration_ns, cold):
        return duration_ns

    def node_of(self, rank):
        return rank // self.gpus_per_node

    def link_capacity(self, link):
        return self.bw

    def collective(self, op: O.Collective) -> CollectivePlan:
        nodes = sorted({self.node_of(r) for r in op.group})
        return CollectivePlan("fixed", self.latency_ns, tuple((Link(LinkKind.NIC, n), float(op.size_bytes)) for n in nodes))
