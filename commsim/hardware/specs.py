"""Hardware specifications: GPUs, nodes, inter-node fabrics, clusters, with sources.

Human units (TFLOPS, GB/s, Gb/s, us) are converted once here into the units the
simulator uses (flops/s, bytes/s, ns). Every constant names its source; the facts
are gathered in ../shared/reference/hardware.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from commsim.hardware.stacks import STACKS, SoftwareStack, stack_preset
from commsim.ir.errors import CommsimInputError

GB = 1e9
TERA = 1e12
US = 1000  # ns
# Softmax: M3's PyTorch (unfused) attention, batch 2, seq 8192, model dim 2048,
# forward: 4 b s^2 h = 1.10e15 flops. A100-80GB (head dim 64) at 46.0 TFLOPS: 23.9 ms,
# of which the GEMM model (gpu_kernels.py) gives its QK^T bmm 7.1 ms, its AV bmm 5.2 ms
# and its head copies 0.25 ms, leaving 11.4 ms for the softmax's read and write of
# 2 x 8.6 GB of fp16 scores: 0.74 of 2039 GB/s. H100 (head dim 128) at 145.1 TFLOPS:
# 7.58 ms, 3.8 ms for 2 x 4.3 GB: 0.68 of 3350 GB/s. Their mean. (G3's "unfused
# softmax 7.6 ms" over 4x16x2048x2048 would be 0.09 of HBM for one fp16 pass: it fits
# a chain of casts, scale, mask and softmax, as Megatron's unfused path runs, not one
# kernel, and is left as a check.)
SOFTMAX_BW_EFFICIENCY = 0.71


@dataclass(frozen=True, slots=True)
class GpuSpec:
    name: str
    peak_tensor_flops_per_s: float  # dense bf16/fp16 tensor-core peak
    peak_fp32_flops_per_s: float  # non-tensor fp32 (elementwise, optimizer)
    hbm_bytes: int
    hbm_bw_bytes_per_s: float
    sm_count: int
    # Fraction of the tensor peak that large, well-shaped GEMMs sustain: a large square
    # GEMM's rate, where waves and the output's write no longer matter. A100: G2's
    # cuBLASLt 16384^3, 256.5 of 312 = 0.822 (G1's 271.2 is mamf-finder's best over a
    # search of shapes, which no one shape of a model's is promised: 5.7% above it).
    # V100: G4's 8192^3 (below). H100 and H200: this workplace's machines, 8192^3 bf16 on
    # random data through PyTorch 2.11 (.library/device/KINDS.md): 798 (H100, 2026-11-13)
    # and 788 (H200, 2026-10-28) of 989, where G1's best shape gives 794.5. The kernel
    # model lowers it for small or odd shapes (gpu_kernels.py).
    gemm_max_efficiency: float = 256.5 / 312
    # Fractions of HBM bandwidth that memory-bound kernels reach, by class:
    # elementwise / copies (M1: STREAM triad, A100-80GB 1.70 of 2.039 TB/s = 0.83,
    # H100 2.97 of 3.35 = 0.89); LayerNorm (M2: plain torch.nn.LayerNorm about 715 GB/s
    # on an A100, variant not named: the 40 GB's 1555 GB/s assumed, 0.46); softmax (M3,
    # see SOFTMAX_BW_EFFICIENCY); dropout (G3: 4x16x2048x2048 fp16 scores in 1.2 ms,
    # reading them and writing them and a one-byte mask, 1.34 GB: 1.12 TB/s, 0.72 of the
    # A100-40GB's 1555 GB/s).
    hbm_efficiency: float = 0.83
    norm_bw_efficiency: float = 0.46
    softmax_bw_efficiency: float = SOFTMAX_BW_EFFICIENCY
    dropout_bw_efficiency: float = 0.72
    # A GPU without bf16 tensor cores runs bf16 matmuls at this rate (None: at the
    # tensor peak like fp16).
    bf16_gemm_flops_per_s: float | None = None
    # Fraction of the 16-bit tensor peak a fused attention kernel (FlashAttention-2, what
    # SDPA runs for causal 16-bit attention on Ampere and Hopper) reaches, counting the
    # matmul flops it does (causal: the half it computes). M3: 179.5 TFLOPS on A100-80GB
    # (head dim 64, batch 2, seq 8192) = 0.575 of 312; 327.9 on H100 (head dim 128) =
    # 0.332 of 989. M3 does not say whether forward, backward or both were timed: the
    # figure prices both. None: no figure (V100 has no FlashAttention-2): a fused
    # attention kernel runs at the GEMM rate of its matmul shape.
    flash_attention_efficiency: float | None = None
    # Fixed device-side cost of any kernel (launch latency on the GPU, tail effects):
    # about 3-5 us for an empty kernel on A100/H100 (NVIDIA CUDA C++ Best Practices).
    kernel_overhead_ns: int = 4 * US


@dataclass(frozen=True, slots=True)
class FabricSpec:
    """Inter-node network of one node: its NICs and their achievable efficiency."""

    name: str
    nics_per_node: int
    nic_rate_bytes_per_s: float  # line rate of one NIC, one direction
    # Achieved fraction of line rate in NCCL collectives (measured busbw / line rate).
    efficiency: float
    # What one network crossing of an NCCL collective costs beyond NCCL's own network-hop
    # latency (tuning.cc hwLat[NET], which was measured on InfiniBand): the fabric, the
    # net plugin and the proxy threads, in the time NCCL runs. Physical time, unlike the
    # latency a plugin *reports* to NCCL's tuner (stacks.PLUGIN_REPORTED_LATENCY_US).
    latency_ns: int
    kind: str  # "efa" or "ib"
    # EFA: the instance type whose NICs these are (aws-ofi-nccl's platform table keys
    # its reported latency, transport and tuner by it); "" for InfiniBand
    instance: str = ""
    # What each network message of a channel costs beyond its bytes, which the next
    # message on that connection waits for (nccl_messages; 0: none modelled)
    message_ns: int = 0

    @property
    def node_bw_bytes_per_s(self) -> float:
        return self.nics_per_node * self.nic_rate_bytes_per_s * self.efficiency


@dataclass(frozen=True, slots=True)
class NodeSpec:
    name: str
    gpu: GpuSpec
    gpus_per_node: int
    # NVLink/NVSwitch bandwidth per GPU, one direction.
    nvlink_bw_bytes_per_s: float
    # Achieved fraction in NCCL ring collectives within a node (hardware.md: 231-235 of
    # 300 GB/s all-reduce busbw on A100, about 78%; NVIDIA/nccl issue 527).
    nvlink_efficiency: float
    pcie_bw_bytes_per_s: float  # host<->device copies (offload, .item())
    fabric: FabricSpec
    price_usd_per_hour: float  # on-demand list price of the whole node
    price_note: str = ""
    # The communication software it runs (stacks.STACKS): NCCL and, on EFA, aws-ofi-nccl.
    stack: SoftwareStack = STACKS["early-2022"]
    # Channels (one CTA, i.e. one SM, each) NCCL's graph search finds inside one node:
    # 24 on an NVSwitch node (the 24-CTA all_gather of published-runs.md X2 on H100;
    # assumed the same on A100's NVSwitch, unsure). Across nodes NCCL uses 2 per NIC
    # (X5: 2 for one NIC, about 16 for 8 NICs): nccl.NcclModel.
    nccl_channels: int = 24


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    node: NodeSpec
    nodes: int

    @property
    def world_size(self) -> int:
        return self.nodes * self.node.gpus_per_node

    @property
    def name(self) -> str:
        stack = self.node.stack
        sw = f"NCCL {stack.nccl_version}"
        if self.node.fabric.kind == "efa":
            sw += f" + aws-ofi-nccl {stack.plugin_version}"
        return f"{self.nodes}x {self.node.name} ({self.node.fabric.name}; {sw})"


# ---------------------------------------------------------------- GPUs
# Peaks: NVIDIA datasheets (dense, no sparsity). SM counts: NVIDIA architecture
# whitepapers (V100 80, A100 108, H100 SXM 132).
# Kernel-class efficiencies (G2, M1-M3, G3) were measured on A100 and H100; the H200
# (the H100's chip) takes the H100's but for its own GEMM figure, the V100 the A100's
# where it has no figure of its own.
_HOPPER = dict(hbm_efficiency=0.89, flash_attention_efficiency=327.9 / 989)
_AMPERE = dict(flash_attention_efficiency=179.5 / 312)
# Memory: what the driver offers a process. A datasheet's "80GB" are GiB of HBM, of which
# the driver keeps a sliver: an H100 80GB HBM3 shows 81559 MiB (of 81920) in nvidia-smi
# (.library/device/KINDS.md, measured 2026-11-13). The other cards are taken as the same
# share of their datasheet GiB (the device library's H200 "about 139 GiB" agrees with the
# 140.4 this gives). Not subtracted: the CUDA context, cuBLAS workspaces, NCCL's buffers.
MIB = 1 << 20
H100_VISIBLE_MIB = 81559


def _visible_bytes(datasheet_gb: int) -> int:
    return int(datasheet_gb * 1024 * MIB * H100_VISIBLE_MIB / 81920) // MIB * MIB


A100_40 = GpuSpec("A100-SXM4-40GB", 312 * TERA, 19.5 * TERA, _visible_bytes(40), 1555 * GB, 108, **_AMPERE)
A100_80 = GpuSpec("A100-SXM4-80GB", 312 * TERA, 19.5 * TERA, _visible_bytes(80), 2039 * GB, 108, **_AMPERE)
H100 = GpuSpec("H100-SXM5-80GB", 989 * TERA, 67 * TERA, H100_VISIBLE_MIB * MIB, 3350 * GB, 132,
               gemm_max_efficiency=798 / 989, **_HOPPER)
H200 = GpuSpec("H200-SXM-141GB", 989 * TERA, 67 * TERA, _visible_bytes(141), 4800 * GB, 132,
               gemm_max_efficiency=788 / 989, **_HOPPER)
# V100: G4's cuBLAS fp16 8192^3 reached 97.4 of 125 TFLOPS (0.78); it has no bf16 tensor
# cores and bf16 matmuls are emulated at about 10 TFLOPS (G4).
V100_32 = GpuSpec("V100-SXM2-32GB", 125 * TERA, 15.7 * TERA, _visible_bytes(32), 900 * GB, 80, gemm_max_efficiency=0.78,
                  bf16_gemm_flops_per_s=10 * TERA)

# ---------------------------------------------------------------- fabrics
# EFA: 100 Gb/s per NIC (AWS instance pages). Efficiency 0.85: "0.4 Tb/s nominal,
# about 340 Gb/s effective in all-reduce" on p4d (stas00/ml-engineering, network; N6).
# Latency of one network crossing beyond NCCL's hwLat[NET] (a Simple-protocol crossing
# pays it twice, as NCCL's tuner counts the network latency twice for Simple: see nccl):
# * p5 (EFA 2nd generation, GPUDirect RDMA): 23 us, the aws-ofi-nccl model tuner's 20 us
#   network latency plus about 3 us completion overhead (src/tuner/nccl_ofi_model.cpp;
#   hardware.md). N2's 8-byte all_reduce (69 us, tree LL) checks it.
# * p4d (EFA 1st generation, GPUDirect RDMA): 20 us, set from published-runs.md N1's
#   8-byte all_reduce on two p4de (164 us): a tree of Simple steps (aws-ofi-nccl sets
#   NCCL_PROTO=simple on p4d, stacks.py) is 2 x (7 NVLink hops x 4 us + 14 us + 2 x 20
#   us) = 164 us with NCCL 2.18's hop latencies.
# * p3dn (EFA 1st generation, no GPUDirect RDMA: data bounce through host memory): 36 us,
#   set from N8: p3dn's 8-byte all_reduce grows 156 us per 4 more ring LL network steps
#   (163 / 319 / 631 us on 2 / 4 / 8 nodes), 39 us per step, less NCCL's 2.7 us LL hop.
#   Efficiency 0.6, set from N7: ring busbw 7.5 GB/s on 2 nodes, 6-8 on 8-32 (NCCL 2.4
#   era), of a 12.5 GB/s NIC.
# Per message (nccl_messages), p4d: 14.5 us, from N1's large sizes on two p4de: 1 -> 2 GiB
# costs 25,189 us more; the tree sends each node's buffer each way over its 8 channels
# (2 per NIC, 6.25 GB/s of line rate each) in 512 KiB messages: 256 messages a channel
# in 25,189 us is 98.4 us each, 83.9 us of them bytes at line rate. (It is the fabric's
# 0.85 efficiency at 512 KiB: 83.9 / 98.4 = 0.853.) Not set for p3dn (no mid-size
# measurement to check one against) nor p5 (aws-ofi-nccl's RDMA transport, no flush).
EFA_P4D = FabricSpec("EFA 4x100Gb/s", 4, 100e9 / 8, 0.85, 20 * US, "efa", "p4d.24xlarge", message_ns=14_500)
EFA_P5 = FabricSpec("EFA 32x100Gb/s", 32, 100e9 / 8, 0.85, 23 * US, "efa", "p5.48xlarge")
EFA_P3DN = FabricSpec("EFA 1x100Gb/s", 1, 100e9 / 8, 0.6, 36 * US, "efa", "p3dn.24xlarge")
# InfiniBand: 200 Gb/s HDR / 400 Gb/s NDR per NIC (DGX user guides). Efficiency 0.96:
# about 192 GB/s all-reduce busbw per DGX A100 node of 200 GB/s line rate (NVIDIA/nccl
# issues 812, 412). Latency: HDR/NDR port latency about 0.5-0.6 us, ~1 us end to end;
# NCCL's hwLat[NET] was measured on InfiniBand and covers the rest.
IB_HDR_8 = FabricSpec("IB 8x200Gb/s HDR", 8, 200e9 / 8, 0.96, 1 * US, "ib")
IB_NDR_8 = FabricSpec("IB 8x400Gb/s NDR", 8, 400e9 / 8, 0.96, 1 * US, "ib")

# PCIe 4.0 x16 about 25 GB/s achievable one way (A100 nodes); PCIe 5.0 x16 about 50.
_PCIE4 = 25 * GB
_PCIE5 = 50 * GB
_PCIE3 = 12 * GB

# ---------------------------------------------------------------- nodes
# Software stacks (stacks.py): p4d, p3dn and dgx-a100 run the seed scenario's early-2022
# stack (NCCL 2.11, aws-ofi-nccl 1.2 on EFA); azure-ndm-a100 the NCCL 2.18.5 of its
# published benchmarks (I1); p5 and dgx-h100 today's (NCCL 2.27, aws-ofi-nccl 1.16).
# cluster_preset(..., stack=...) picks another.
NODE_PRESETS: dict[str, NodeSpec] = {
    n.name: n
    for n in (
        # 600 GB/s bidirectional NVSwitch per GPU = 300 one way (AWS p4d page).
        NodeSpec("p4d", A100_40, 8, 300 * GB, 0.78, _PCIE4, EFA_P4D, 32.77,
                 "AWS on-demand us-east-1 p4d.24xlarge, as listed 2022-2024", STACKS["early-2022"]),
        # 900 GB/s bidirectional NVSwitch = 450 one way (AWS p5 page); H100 ring busbw
        # about 370 GB/s (nccl-tests issue 212) -> 0.82.
        NodeSpec("p5", H100, 8, 450 * GB, 0.82, _PCIE5, EFA_P5, 98.32,
                 "AWS on-demand us-east-1 p5.48xlarge, as listed 2024", STACKS["2025"]),
        NodeSpec("dgx-a100", A100_80, 8, 300 * GB, 0.78, _PCIE4, IB_HDR_8, 32.77,
                 "no list price; priced as a p4d node (same GPUs) for comparison", STACKS["early-2022"]),
        NodeSpec("dgx-h100", H100, 8, 450 * GB, 0.82, _PCIE5, IB_NDR_8, 98.32,
                 "no list price; priced as a p5 node (same GPUs) for comparison", STACKS["2025"]),
        # p3dn: NVLink2 hybrid cube mesh, 6 links x 25 GB/s = 150 GB/s per V100 one way
        # (V100 datasheet 300 GB/s bidirectional); ring efficiency assumed as A100's.
        # Channels: 12 rings over the mesh's 6 links (2 per link), assumed.
        NodeSpec("p3dn", V100_32, 8, 150 * GB, 0.78, _PCIE3, EFA_P3DN, 31.212,
                 "AWS on-demand us-east-1 p3dn.24xlarge, as listed 2022-2024", STACKS["early-2022"],
                 nccl_channels=12),
        NodeSpec("azure-ndm-a100", A100_80, 8, 300 * GB, 0.78, _PCIE4, IB_HDR_8, 32.77,
                 "Azure ND96amsr A100 v4 pay-as-you-go, about 32.77 USD/h (2023)", STACKS["2023"]),
    )
}

FABRICS = {"efa": EFA_P4D, "ib": IB_HDR_8}


def cluster_preset(name: str, nodes: int, net: str | None = None, gpus_per_node: int | None = None,
                   stack: str | None = None) -> ClusterSpec:
    """A node preset times ``nodes``; ``net`` swaps the inter-node fabric (same NIC count
    and line rate as the node's, EFA's or InfiniBand's efficiency and latency); ``stack``
    picks the software stack (stacks.STACKS: "early-2022", "2023", "2025") instead of the
    node's own."""
    if name not in NODE_PRESETS:
        raise CommsimInputError(f"--cluster {name!r}: allowed: {', '.join(NODE_PRESETS)}")
    if nodes <= 0:
        raise CommsimInputError("--nodes must be a positive integer")
    node = NODE_PRESETS[name]
    if net is not None:
        node = replace(node, fabric=swap_fabric(node.fabric, net))
    if gpus_per_node is not None:
        if gpus_per_node <= 0:
            raise CommsimInputError("--gpus-per-node must be a positive integer")
        node = replace(node, gpus_per_node=gpus_per_node)
    if stack is not None:
        node = replace(node, stack=stack_preset(stack))
    return ClusterSpec(node, nodes)


def swap_fabric(fabric: FabricSpec, net: str) -> FabricSpec:
    """The what-if of the seed paper: the same node, EFA or InfiniBand between nodes.

    ``ib`` on an EFA node: DGX-style 8x200 Gb/s HDR InfiniBand (the DGX A100 fabric);
    ``efa`` on an InfiniBand node: p4d's 4x100 Gb/s EFA. The node's own fabric is kept
    when it already is of that kind.
    """
    if net not in FABRICS:
        raise CommsimInputError(f"--net {net!r}: allowed: {', '.join(FABRICS)}")
    if fabric.kind == net:
        return fabric
    return FABRICS[net]
