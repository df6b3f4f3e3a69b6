"""Software stacks: the NCCL release and, on EFA, the aws-ofi-nccl plugin a preset runs.

The same p4d node moves mid-size messages up to 2x apart across NCCL / aws-ofi-nccl
versions (published-runs.md N2), so a node preset names its stack and a user may pick
another (``specs.cluster_preset(..., stack=...)``). A stack decides:

* NCCL's tuning model (``nccl_tuning``): its latency and bandwidth constants, which
  algorithms exist (NVLS from 2.17), how the latency of a ring across nodes is counted;
* on EFA, the plugin's part: the latency it reports to NCCL's tuner (per instance type,
  aws/aws-ofi-nccl src/platform-aws: a tuning input, not the wire's latency), whether its
  own tuner picks the algorithm (then from its model of the real network, see ``nccl``),
  and which protocols it leaves NCCL (``NCCL_PROTO`` it sets where LL / LL128 are unsafe).

On InfiniBand the plugin fields are unused: NCCL's own IB transport reports no latency.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from commsim.hardware.nccl_tuning import NCCL_2_10, NCCL_2_18, NCCL_2_27, NcclTuning
from commsim.ir.errors import CommsimInputError

# The latency (us) aws-ofi-nccl reports to NCCL's tuner per instance type
# (aws/aws-ofi-nccl src/platform-aws.c(pp), platform table; shared/reference/hardware.md).
PLUGIN_REPORTED_LATENCY_US = MappingProxyType({
    "p3dn.24xlarge": 150.0, "p4d.24xlarge": 75.0, "p4de.24xlarge": 75.0, "p5.48xlarge": 75.0,
    "p5e.48xlarge": 75.0, "p5en.48xlarge": 35.0, "p6-b200.48xlarge": 35.0,
})

# Instance types on which aws-ofi-nccl's default transport is its "RDMA" protocol (the
# others use "SENDRECV"): p5 and newer (platform-aws default_protocol; as I recall it).
RDMA_PROTOCOL_INSTANCES = frozenset({"p5.48xlarge", "p5e.48xlarge", "p5en.48xlarge", "p6-b200.48xlarge"})
# Instance types aws-ofi-nccl's tuner covers (src/tuner: the p5 family and newer).
TUNER_INSTANCES = RDMA_PROTOCOL_INSTANCES


@dataclass(frozen=True, slots=True)
class SoftwareStack:
    """The communication software of a preset: NCCL, and on EFA the net plugin."""

    name: str  # preset name: "early-2022", "2023", "2025"
    nccl_version: str  # the release modelled, e.g. "2.11"
    tuning: NcclTuning
    plugin_version: str  # aws-ofi-nccl release on EFA, e.g. "1.2"
    # the plugin reports its platform's latency to NCCL's tuner (needs NCCL's net API v6
    # and a plugin that sets it: aws-ofi-nccl 1.7 or so, unsure of the exact release)
    plugin_reports_latency: bool
    # the plugin's own tuner (aws-ofi-nccl 1.9+, NCCL 2.19+) picks algorithm and protocol
    # on the instances it covers
    plugin_tuner: bool
    # the plugin sets NCCL_PROTO where NCCL's protocols are unsafe over EFA (from 1.7, as
    # I recall it): "simple" with its SENDRECV transport ("Use the simple protocol
    # whenever we're not using the rdma protocol", platform-aws), and LL128 off with its
    # RDMA transport (LL128 needs 128-byte writes to land in order; unsure whether p5's
    # EFA is exempt by 1.16: published-runs.md N4's per-node slope, about 60 us per
    # network step at 32 MiB, fits Simple steps and not LL128's)
    simple_unless_rdma: bool
    note: str = ""

    @property
    def describe(self) -> str:
        return f"NCCL {self.nccl_version} + aws-ofi-nccl {self.plugin_version} on EFA"

    def plugin_latency_us(self, instance: str) -> float:
        """The latency the plugin reports to NCCL for ``instance`` (0: none reported)."""
        if not (self.plugin_reports_latency and self.tuning.reads_net_latency):
            return 0.0
        return PLUGIN_REPORTED_LATENCY_US.get(instance, 0.0)

    def tuner_on(self, instance: str) -> bool:
        return self.plugin_tuner and instance in TUNER_INSTANCES

    def efa_protocols(self, instance: str) -> tuple[str, ...] | None:
        """Protocols the plugin leaves NCCL on ``instance`` (None: NCCL's own defaults)."""
        if not self.simple_unless_rdma:
            return None
        if instance not in RDMA_PROTOCOL_INSTANCES:
            return ("Simple",)
        return ("LL", "Simple")


STACKS = MappingProxyType({s.name: s for s in (
    # The seed scenario's software (shared/reference/scenarios.md): NCCL 2.10-2.11 with
    # aws-ofi-nccl 1.1-1.2. The plugin reports no latency (NCCL 2.11's net API v4 has no
    # field for it), has no tuner, and sets no NCCL_PROTO: NCCL enables LL128 wherever
    # its own rule allows (Ampere, NVLink inside, NIC reached through PCIe switches).
    SoftwareStack("early-2022", "2.11", NCCL_2_10, "1.2", plugin_reports_latency=False, plugin_tuner=False,
                  simple_unless_rdma=False, note="seed scenario (scenarios.md)"),
    # published-runs.md N2's "older stack": EFA installer 1.28, aws-ofi-nccl 1.7.3, NCCL
    # 2.18.5; also I1 / I3's Azure runs (NCCL 2.18.5).
    SoftwareStack("2023", "2.18.5", NCCL_2_18, "1.7.3", plugin_reports_latency=True, plugin_tuner=False,
                  simple_unless_rdma=True, note="N2's older stack"),
    # published-runs.md N3 / N4: aws-ofi-nccl 1.16.3 with its tuner, NCCL 2.27.7.
    SoftwareStack("2025", "2.27.7", NCCL_2_27, "1.16.3", plugin_reports_latency=True, plugin_tuner=True,
                  simple_unless_rdma=True, note="N3 / N4's stack"),
)})

CURRENT = "2025"


def stack_preset(name: str) -> SoftwareStack:
    if name not in STACKS:
        raise CommsimInputError(f"--nccl-stack {name!r}: allowed: {', '.join(STACKS)}")
    return STACKS[name]
