"""The kernels and activations of FSDP2's step: each module's forward, recompute and
backward kernels on the compute stream, with the parameters, gradients and activation
buffers they read and write (a mixin of ``fsdp2.FSDP2Lowering``, whose state it uses)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from commsim.ir import ops as O
from commsim.ir.ops import Phase
from commsim.models.spec import ModuleSpec
from commsim.strategies.fsdp2_comm import COMPUTE

if TYPE_CHECKING:
    from commsim.strategies.fsdp2 import _Group


class FSDP2Kernels:
    """Kernel and activation lowering; the attributes it reads are FSDP2Lowering's."""

    def _elementwise(self, label: str, n: int, read: int, written: int, buffers: tuple[str, ...]) -> None:
        self.b.host("launch", O.HostKind.LAUNCH, self.costs.launch_ns)
        self.b.compute(COMPUTE, label, O.ComputeKind.ELEMENTWISE, n, read, written,
                       deps=self.streams.deps(COMPUTE), buffers=buffers)

    def _kernels(self, g: _Group, modules: tuple[ModuleSpec, ...], phase: Phase) -> None:
        b, mb = self.b, self.mb
        for m in modules:
            kernels = m.bwd if phase is Phase.BACKWARD else m.fwd
            if not kernels:
                continue
            grads, new = self._grads_for(g, m) if phase is Phase.BACKWARD else ((), ())
            act = self._act_before(m, phase)
            for k in kernels:
                b.host("launch", O.HostKind.LAUNCH, self.costs.launch_ns)
                suffix = "" if k.name in ("fwd", "bwd") else f".{k.name}"
                b.compute(COMPUTE, f"{mb}{m.path}.{phase.value}{suffix}", k.kind, k.flops, k.bytes_read,
                          k.bytes_written, k.gemm, deps=self.streams.deps(COMPUTE),
                          buffers=self._params_of(m) + grads + new + act)
            for name in new:  # AccumulateGrad into the gradient kept from an earlier micro-step
                pname = name.removeprefix("ugnew:")
                n = self.numel[pname]
                self._elementwise(f"{mb}{m.path}.accumulate_grad", n, 2 * n * self.gdt.itemsize_bytes,
                                  n * self.gdt.itemsize_bytes, (f"ugrad:{pname}", name))
                b.free(name, COMPUTE, "new gradient (accumulated)")
            self._act_after(m, phase)

    def _params_of(self, m: ModuleSpec) -> tuple[str, ...]:
        return tuple(dict.fromkeys(f"param:{p.name}" for p in m.params))

    def _grads_for(self, g: _Group, m: ModuleSpec) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The unsharded gradients ``m``'s backward writes: a parameter's is allocated at its
        first use in this backward (a tied one's second use adds into it); one kept from an
        earlier micro-step without sync gets a new gradient added into it (AccumulateGrad)."""
        grads, new = [], []
        for p in dict.fromkeys(m.params):
            name = f"ugrad:{p.name}"
            if p.name not in self.seen_grads:
                self.seen_grads.add(p.name)
                if p.name in g.ugrads:
                    self.b.alloc(f"ugnew:{p.name}", p.numel * self.gdt.itemsize_bytes, COMPUTE,
                                 f"new gradient of {p.name}")
                    new.append(f"ugnew:{p.name}")
                else:
                    self.b.alloc(name, p.numel * self.gdt.itemsize_bytes, COMPUTE, f"unsharded gradient of {p.name}")
                    g.ugrads.add(p.name)
            grads.append(name)
        return tuple(grads), tuple(new)

    def _act_before(self, m: ModuleSpec, phase: Phase) -> tuple[str, ...]:
        """Activations: every forward output kept for backward without checkpointing; with
        it, only each block's input, the rest re-created by the recompute."""
        if not m.fwd:
            return ()
        name = f"{self.mb}act:{m.path}"
        if phase in (Phase.FORWARD, Phase.RECOMPUTE):
            if phase is Phase.FORWARD and self.checkpointing and m.block is not None \
                    and self.block_first.get(m.block) == m.path:
                self.b.alloc(f"{self.mb}ckpt:{m.block}", self._ckpt_bytes(m), COMPUTE,
                             f"checkpointed input of block {m.block}")
            if m.activation_bytes:  # a module whose outputs autograd does not keep has none
                self.b.alloc(name, m.activation_bytes, COMPUTE, f"activation {m.path}")
        return (name,) if m.activation_bytes else ()

    def _act_after(self, m: ModuleSpec, phase: Phase) -> None:
        if not m.fwd:
            return
        name = f"{self.mb}act:{m.path}"
        if phase is Phase.FORWARD and self.checkpointing and m.block is not None:
            if m.activation_bytes:
                self.b.free(name, COMPUTE, "activation not kept (checkpointed block)")
        elif phase is Phase.BACKWARD:
            if m.activation_bytes:
                self.b.free(name, COMPUTE, "activation consumed by backward")
            if self.checkpointing and m.block is not None and self.block_first.get(m.block) == m.path:
                self.b.free(f"{self.mb}ckpt:{m.block}", COMPUTE, f"checkpointed input of block {m.block}")

    def _ckpt_bytes(self, first: ModuleSpec) -> int:
        if self.md.arch is not None:
            return self.md.tokens * self.md.arch.hidden * self.md.dtype_bytes
        return max(1, sum(k.bytes_written for k in first.fwd))

