"""Torch-free model descriptions: the submodule tree that ZeRO's hooks see.

A ``ModelDescription`` lists the model's leaf submodules in forward execution order.
Each ``ModuleSpec`` carries the parameters it owns directly (what a ZeRO-3 fetch of
that submodule gathers; a tied parameter appears under every module that uses it, with
one name) and the kernels its forward and backward run at a given micro-batch and
sequence length. Parameter-free submodules (attention core, activations, the loss)
carry compute only.

Descriptions come from the transformer catalogue (``commsim.models.transformer``),
from a Hugging Face ``config.json`` (``commsim.models.hf``) or from a real
``torch.nn.Module`` walked on the meta device (``commsim.models.torch_walk``); all produce
the same structure.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from math import prod

from commsim.ir.ops import ComputeKind, GemmShape, Phase


class ModuleKind(enum.Enum):
    EMBEDDING = "embedding"
    LINEAR = "linear"
    NORM = "norm"  # LayerNorm / RMSNorm
    ATTENTION = "attention"  # the parameter-free score / softmax / context part
    ACTIVATION = "activation"  # GELU, SiLU*up, dropout: parameter-free elementwise
    LOSS = "loss"  # cross-entropy over the vocabulary
    OTHER = "other"


class Role(enum.Enum):
    """Which published parameter category a module's parameters count toward."""

    EMBEDDING = "embedding"
    ATTENTION_QKV = "attention_qkv"
    ATTENTION_OUT = "attention_out"
    MLP = "mlp"
    NORM = "norm"
    LM_HEAD = "lm_head"
    POOLER = "pooler"
    OTHER = "other"  # parameters of a module the catalogue did not classify (walked models)
    NONE = "none"  # parameter-free


# DeepSpeedTransformerLayer's bias parameters (its names do not end in "bias")
DEEPSPEED_LAYER_BIASES = frozenset({"attn_qkvb", "attn_ob", "attn_nb", "inter_b", "output_b", "norm_b"})


@dataclass(frozen=True, slots=True)
class ParamSpec:
    name: str  # canonical (first owner's) dotted name; tied parameters share it
    shape: tuple[int, ...]
    # the category it counts toward when it differs from its module's (a fused layer's
    # parameters: DeepSpeed's transformer kernel holds a whole layer in one module)
    role: "Role | None" = field(default=None, compare=False)

    @property
    def numel(self) -> int:
        return prod(self.shape)


@dataclass(frozen=True, slots=True)
class Kernel:
    """One kernel of a module's forward or backward (a gemm, an elementwise pass, ...).

    ``kind`` is the kernel's class, which decides how it is priced. ``shape`` and
    ``dtype`` describe the tensor it writes (a GEMM's is its output; empty for kernels
    from models walked without them); bytes count every tensor read once and every
    tensor written once (a broadcast operand by its own size).
    """

    name: str  # suffix for labels: "fwd", "dgrad", "wgrad", "softmax", ...
    kind: ComputeKind
    flops: int
    bytes_read: int
    bytes_written: int
    gemm: GemmShape | None = None
    shape: tuple[int, ...] = ()
    dtype: str = ""  # element type written: "bf16" (any 2-byte float), "fp32", "int64", "bool", ...


@dataclass(frozen=True, slots=True)
class ModuleSpec:
    path: str  # dotted module path, as named_modules() would give
    kind: ModuleKind
    role: Role
    params: tuple[ParamSpec, ...]  # parameters owned directly (recurse=False)
    block: int | None  # transformer layer index: the activation-checkpointing unit
    fwd: tuple[Kernel, ...]
    bwd: tuple[Kernel, ...]
    # How many of the modules that follow (in forward order) run inside this one: a
    # container with parameters of its own (e.g. RoBERTa's lm_head, which owns the
    # decoder bias) is fetched before its children and released after them.
    encloses: int = 0
    # Bytes of this module's forward outputs that autograd keeps for backward (saved
    # tensors, each counted once, by the module that made it). None: not modelled for
    # this module; every output of its forward kernels is kept (an upper bound).
    saved_bytes: int | None = None
    # The module's forward (recompute included) / backward waits on the host for the
    # compute stream to drain before it launches its kernels (a cudaStreamSynchronize
    # inside a custom op, a device-to-host copy of a count, ...).
    sync_before_fwd: bool = False
    sync_before_bwd: bool = False

    def syncs_before(self, phase: Phase) -> bool:
        """Whether the host waits for the compute stream before this module's kernels of
        ``phase`` (recompute runs the forward)."""
        return self.sync_before_bwd if phase is Phase.BACKWARD else self.sync_before_fwd

    @property
    def activation_bytes(self) -> int:
        """What this module's forward leaves alive until its backward."""
        return sum(k.bytes_written for k in self.fwd) if self.saved_bytes is None else self.saved_bytes

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def fwd_flops(self) -> int:
        return sum(k.flops for k in self.fwd)

    @property
    def bwd_flops(self) -> int:
        return sum(k.flops for k in self.bwd)


@dataclass(frozen=True, slots=True)
class ArchInfo:
    """Shape facts the Megatron-LM flops formula needs (None for arbitrary modules)."""

    layers: int
    hidden: int
    vocab: int
    ffn: int
    heads: int


@dataclass(frozen=True, slots=True)
class ModelDescription:
    name: str
    modules: tuple[ModuleSpec, ...]  # forward execution order
    micro_batch: int
    seq_len: int
    dtype_bytes: int  # bytes per element of 16-bit params / activations
    arch: ArchInfo | None = None
    # Parameter names in named_parameters() order (registration order), when it differs
    # from first use: ZeRO-3 orders its persistent-parameter list this way.
    param_order: tuple[str, ...] = ()

    # ------------------------------------------------------------ parameters
    def unique_params(self) -> tuple[ParamSpec, ...]:
        """Each parameter once, in order of first use."""
        seen: dict[str, ParamSpec] = {}
        for m in self.modules:
            for p in m.params:
                if p.name in seen:
                    assert seen[p.name].shape == p.shape, f"tied parameter {p.name} has two shapes"
                else:
                    seen[p.name] = p
        return tuple(seen.values())

    def registered_params(self) -> tuple[ParamSpec, ...]:
        """Each parameter once, in named_parameters() order."""
        first_use = self.unique_params()
        if not self.param_order:
            return first_use
        by_name = {p.name: p for p in first_use}
        assert set(self.param_order) == set(by_name), "param_order must name every parameter once"
        return tuple(by_name[n] for n in self.param_order)

    @property
    def num_params(self) -> int:
        return sum(p.numel for p in self.unique_params())

    def param_breakdown(self) -> dict[str, int]:
        """Parameter counts by category (each parameter counted once, under its first owner)."""
        out: dict[str, int] = {r.value: 0 for r in Role if r is not Role.NONE}
        out["biases"] = 0
        seen: set[str] = set()
        for m in self.modules:
            for p in m.params:
                if p.name in seen:
                    continue
                seen.add(p.name)
                out[(p.role or m.role).value] += p.numel
                if p.name.endswith("bias") or p.name.rsplit(".", 1)[-1] in DEEPSPEED_LAYER_BIASES:
                    out["biases"] += p.numel
        out["total"] = self.num_params
        return out

    # ------------------------------------------------------------ flops
    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_len

    def forward_flops(self) -> int:
        return sum(m.fwd_flops for m in self.modules)

    def backward_flops(self) -> int:
        return sum(m.bwd_flops for m in self.modules)

    def recompute_flops(self) -> int:
        """Forward flops re-run by layer-wise activation checkpointing."""
        return sum(m.fwd_flops for m in self.modules if m.block is not None)

    def num_blocks(self) -> int:
        blocks = {m.block for m in self.modules if m.block is not None}
        return len(blocks)
