"""NCCL's own tuning constants, per NCCL version (NVIDIA/nccl src/graph/tuning.cc).

NCCL prices every (algorithm, protocol) pair of a collective with a latency plus a
bandwidth, and runs the cheapest (``ncclTopoTuneModel`` fills the tables when a
communicator is created, ``ncclTopoGetAlgoTime`` prices one call). The constants below
are the ones that model reads, as they stood in the NCCL versions the software stacks of
``stacks`` name. Latencies in microseconds, bandwidths in GB/s (1e9 B/s), as NCCL keeps
them; ``nccl`` converts them once.

The tables (``baseLat``, ``hwLat``, ``llMaxBws``, ``perChMaxTreeBws``, the LL128
per-channel ceilings and ``treeCorrectionFactor``) are the released binaries' own, read
out of their data sections by ``bench/nccl_constants.py`` into ``docs/nccl/*.json``
(NCCL 2.10.3 from PyTorch 1.11.0's wheel, 2.18.3 and 2.27.7 from ``nvidia-nccl-cu12``);
tests/hardware/test_nccl_tables.py checks every value here against those files. The
model's structure around them (which terms a release adds, the bandwidth factors in
``nccl``) is read from tuning.cc as the comments say. Algorithms are "ring", "tree",
"nvls" (NVLink SHARP, one H100 node) and "nvls_tree" (NVLS inside the node, a tree across
nodes); protocols "LL", "LL128", "Simple". Hardware classes for per-hop latency: "nvlink",
"pci", "net".
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

ALGORITHMS = ("ring", "tree", "nvls", "nvls_tree")
PROTOCOLS = ("LL", "LL128", "Simple")

# The protocols' line formats (src/include/device.h): an LL line is 16 bytes carrying 8
# data bytes (each 4-byte word paired with a 4-byte flag); an LL128 line is 128 bytes
# carrying 120 data bytes (one 8-byte flag per line). Simple moves the data as it is.
# These are bytes on the wire, so they are link demands (see nccl's docstring).
WIRE_FACTOR = MappingProxyType({"LL": 2.0, "LL128": 128.0 / 120.0, "Simple": 1.0})

# NCCL_STEPS slots per connection; the Simple buffer (NCCL_BUFFSIZE default 4 MiB) is cut
# into that many steps (src/include/collectives.h, src/init.cc: DEFAULT_BUFFSIZE).
NCCL_STEPS = 8
SIMPLE_BUFFSIZE = 4 << 20
# Threads per channel and the bytes each must have before NCCL adds a channel
# (src/include/device.h NCCL_*_MAX_NTHREADS; src/graph/tuning.cc NCCL_*_THREAD_THRESHOLD;
# the ring LL threshold is multiplied by the number of ranks). enqueue.cc drops channels
# while bytes < channels x threads x threshold.
MAX_NTHREADS = MappingProxyType({"LL": 512, "LL128": 640, "Simple": 512})
THREAD_THRESHOLD = MappingProxyType({"LL": 8, "LL128": 8, "Simple": 64})
MAXCHANNELS = 32  # src/include/device.h (2.10-2.18; 64 from 2.19 on H100, not needed here)


def _table(rows: dict) -> Mapping:
    return MappingProxyType({k: MappingProxyType(v) if isinstance(v, dict) else v for k, v in rows.items()})


@dataclass(frozen=True, slots=True)
class NcclTuning:
    """The tuning model of one NCCL version (see the module docstring)."""

    version: str  # e.g. "2.10": the oldest release these constants describe
    # baseLat[algorithm][protocol], us: a call's fixed cost
    base_lat_us: Mapping[str, Mapping[str, float]]
    # hwLat[hw][algorithm][protocol], us: one hop over NVLink, PCI or the network
    hw_lat_us: Mapping[str, Mapping[str, Mapping[str, float]]]
    # llMaxBws[arch][nodes index] GB/s: the LL protocol's total bus bandwidth ceiling.
    # arch "volta" / "ampere" / "hopper"; nodes index 0: one node, 1: two, 2: more.
    # (On one node NCCL picks the row by GPU, across nodes by CPU vendor: Intel rows.)
    ll_max_bw: Mapping[str, tuple[float, float, float]]
    # perChMaxTreeBws[arch][nodes index] GB/s per channel: the tree's ceiling
    tree_max_bw_per_channel: Mapping[str, tuple[float, float, float]]
    # the LL128 ceilings per channel, GB/s, [arch][nodes index]: perChMaxRingLL128Bws and
    # perChMaxTreeLL128Bws (2.10 has one ll128MaxBwPerCh = 20 for both)
    ring_ll128_max_bw_per_channel: Mapping[str, tuple[float, float, float]]
    tree_ll128_max_bw_per_channel: Mapping[str, tuple[float, float, float]]
    # treeCorrectionFactor[protocol][log2(bytes / 64)] for 64 B .. 256 MiB: "Trees are
    # not perfectly sticking to the model for medium sizes" (ncclTopoGetAlgoTime)
    tree_correction: Mapping[str, tuple[float, ...]]
    # ring Simple all-reduce across nodes: latency x this ("Plateau effect of ring"),
    # by arch, once each rank's share per channel is >= 64 bytes
    ring_plateau: Mapping[str, float]
    # True from 2.12: a ring's latency counts its intra-node steps at the intra-node hop
    # and only its network steps at the network hop (with NCCL's per-step net overhead);
    # before, a multi-node ring paid the network hop on every step.
    ring_split_latency: bool
    # the net plugin's reported latency (ncclNetProperties_t.latency, net API v6) is added
    # to every network hop, and once more for Simple (the receive flush); 2.10's net API
    # (v4) has no latency field
    reads_net_latency: bool
    # NVLS (NVLink SHARP) all-reduce on one node, and NVLS+tree across nodes (2.17 / 2.18)
    has_nvls: bool
    # getNetOverhead(): the proxy's cost per ring step across nodes, us (x3 for Simple)
    net_overhead_us: float

    @property
    def release(self) -> tuple[int, ...]:
        return tuple(int(x) for x in self.version.split("."))


# Rows shared by the three releases (the same in all three binaries):
_TREE_CORRECTION = {
    "LL": (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0),
    "LL128": (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0),
    "Simple": (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9),
}

_LL128_20 = MappingProxyType({a: (20.0, 20.0, 20.0) for a in ("volta", "ampere", "hopper")})

# NCCL 2.10-2.11 (2.10.3; the early-2022 software of the seed scenario). 2.10 knows Volta
# and Ampere only: Hopper takes Ampere's rows, as an unknown compute capability does there.
NCCL_2_10 = NcclTuning(
    version="2.10",
    base_lat_us=_table({"ring": {"LL": 3.6, "LL128": 10.0, "Simple": 8.4},
                        "tree": {"LL": 4.4, "LL128": 4.4, "Simple": 0.0}}),
    # "Tree/Simple is the latency a 256kB chunk, which is ~ base lat + 256k/12GB/s
    # (+ 256k/12GB/s for the network)": hence 28 us per tree hop for Simple.
    hw_lat_us=_table({
        "nvlink": MappingProxyType({"tree": MappingProxyType({"LL": .52, "LL128": 1.25, "Simple": 28.0}),
                                    "ring": MappingProxyType({"LL": .47, "LL128": 1.9, "Simple": 3.4})}),
        "pci": MappingProxyType({"tree": MappingProxyType({"LL": 1.0, "LL128": 1.9, "Simple": 28.0}),
                                 "ring": MappingProxyType({"LL": 1.0, "LL128": 2.5, "Simple": 5.7})}),
        "net": MappingProxyType({"tree": MappingProxyType({"LL": 5.0, "LL128": 8.5, "Simple": 28.0}),
                                 "ring": MappingProxyType({"LL": 2.7, "LL128": 4.0, "Simple": 9.6})}),
    }),
    ll_max_bw=MappingProxyType({"volta": (39.0, 39.0, 20.4), "ampere": (87.7, 22.5, 19.0),
                                "hopper": (87.7, 22.5, 19.0)}),  # no Hopper row before 2.12: Ampere's
    tree_max_bw_per_channel=MappingProxyType({"volta": (26.5, 18.5, 10.0), "ampere": (24.0, 23.6, 17.8),
                                              "hopper": (24.0, 23.6, 17.8)}),
    ring_ll128_max_bw_per_channel=_LL128_20,
    tree_ll128_max_bw_per_channel=_LL128_20,
    tree_correction=MappingProxyType(_TREE_CORRECTION),
    ring_plateau=MappingProxyType({"volta": 1.9, "ampere": 1.4, "hopper": 1.4}),
    ring_split_latency=False,
    reads_net_latency=False,
    has_nvls=False,
    net_overhead_us=0.0,
)

def _hopper_era_hw_lat(pci_tree_simple: float, nvls_nvlink: float, nvls_tree_net: float) -> Mapping:
    """hwLat of 2.18 and 2.27: the same rows but for the PCI tree's Simple hop, the NVLS
    algorithms' NVLink hop and NVLS tree's network hop (their binaries' tables)."""
    def row(ll: float, ll128: float, simple: float) -> Mapping:
        return MappingProxyType({"LL": ll, "LL128": ll128, "Simple": simple})

    return _table({
        "nvlink": MappingProxyType({"tree": row(.6, 1.25, 4.0), "ring": row(.6, 1.9, 3.4),
                                    "nvls": row(0.0, 0.0, nvls_nvlink), "nvls_tree": row(0.0, 0.0, nvls_nvlink)}),
        "pci": MappingProxyType({"tree": row(1.0, 1.9, pci_tree_simple), "ring": row(1.0, 2.5, 5.7),
                                 "nvls": row(0.0, 0.0, 0.0), "nvls_tree": row(0.0, 0.0, 0.0)}),
        "net": MappingProxyType({"tree": row(5.0, 8.5, 14.0), "ring": row(2.7, 4.0, 14.0),
                                 "nvls": row(0.0, 0.0, 18.0), "nvls_tree": row(0.0, 0.0, nvls_tree_net)}),
    })


# NCCL 2.18-2.19 (2.18.3, the nearest to the 2023 stack's 2.18.5 on the registry). NVLS:
# a 23 us base and no per-hop NVLink cost on one node; an 18 us network hop for NVLS, 19 us
# for NVLS tree.
NCCL_2_18 = NcclTuning(
    version="2.18",
    base_lat_us=_table({"ring": {"LL": 6.6, "LL128": 14.0, "Simple": 8.4},
                        "tree": {"LL": 6.8, "LL128": 14.0, "Simple": 0.0},
                        "nvls": {"LL": 0.0, "LL128": 0.0, "Simple": 23.0},
                        "nvls_tree": {"LL": 0.0, "LL128": 0.0, "Simple": 23.0}}),
    hw_lat_us=_hopper_era_hw_lat(pci_tree_simple=6.0, nvls_nvlink=0.0, nvls_tree_net=19.0),
    ll_max_bw=MappingProxyType({"volta": (39.0, 39.0, 20.4), "ampere": (87.7, 22.5, 19.0),
                                "hopper": (87.7, 22.5, 19.0)}),
    tree_max_bw_per_channel=MappingProxyType({"volta": (26.5, 18.5, 10.0), "ampere": (24.0, 23.6, 17.8),
                                              "hopper": (38.7, 41.4, 36.0)}),
    ring_ll128_max_bw_per_channel=MappingProxyType({"volta": (20.0, 20.0, 20.0), "ampere": (20.0, 20.0, 20.0),
                                                    "hopper": (36.7, 36.7, 29.0)}),
    tree_ll128_max_bw_per_channel=MappingProxyType({"volta": (20.0, 20.0, 20.0), "ampere": (20.0, 20.0, 20.0),
                                                    "hopper": (36.7, 36.7, 36.7)}),
    tree_correction=MappingProxyType(_TREE_CORRECTION),
    ring_plateau=MappingProxyType({"volta": 1.9, "ampere": 1.4, "hopper": 1.4}),
    ring_split_latency=True,
    reads_net_latency=True,
    has_nvls=True,
    # getNetOverhead(): 1 us on Intel hosts, 2 us on AMD (the presets' hosts are Intel)
    net_overhead_us=1.0,
)

# NCCL 2.27 (2.27.7): the tables retuned for Hopper (LL ceilings, a Simple tree base, NVLS
# priced as a 25 us NVLink hop, a 14 us NVLS-tree network hop, PCI tree Simple 4 us).
# PAT (one GPU per node) is not modelled: the presets never have one GPU per node. The
# fields outside the tables are taken as 2.18's.
NCCL_2_27 = NcclTuning(
    version="2.27",
    base_lat_us=_table({"ring": {"LL": 6.6, "LL128": 14.0, "Simple": 8.4},
                        "tree": {"LL": 6.8, "LL128": 14.0, "Simple": 8.4},
                        "nvls": {"LL": 0.0, "LL128": 0.0, "Simple": 0.0},
                        "nvls_tree": {"LL": 0.0, "LL128": 0.0, "Simple": 0.0}}),
    hw_lat_us=_hopper_era_hw_lat(pci_tree_simple=4.0, nvls_nvlink=25.0, nvls_tree_net=14.0),
    ll_max_bw=MappingProxyType({"volta": (39.0, 39.0, 20.4), "ampere": (87.7, 22.5, 19.0),
                                "hopper": (141.0, 45.0, 35.0)}),
    tree_max_bw_per_channel=NCCL_2_18.tree_max_bw_per_channel,
    ring_ll128_max_bw_per_channel=NCCL_2_18.ring_ll128_max_bw_per_channel,
    tree_ll128_max_bw_per_channel=NCCL_2_18.tree_ll128_max_bw_per_channel,
    tree_correction=MappingProxyType(_TREE_CORRECTION),
    ring_plateau=NCCL_2_18.ring_plateau,
    ring_split_latency=True,
    reads_net_latency=True,
    has_nvls=True,
    net_overhead_us=NCCL_2_18.net_overhead_us,
)

TUNINGS = MappingProxyType({t.version: t for t in (NCCL_2_10, NCCL_2_18, NCCL_2_27)})


def arch_of(gpu_name: str) -> str:
    """NCCL's compute-capability class of a GPU spec (by its name)."""
    name = gpu_name.upper()
    if name.startswith("V100"):
        return "volta"
    if name.startswith(("H100", "H200")):
        return "hopper"
    return "ampere"
