"""The kernels of FSDP2's step: each module's forward, recompute and backward kernels
on the compute stream, with the parameters, gradients and activation buffers
(``activations.Activations``) they read and write (a mixin of ``fsdp2.FSDP2Lowering``,
whose state it uses)."""

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
            act = self.acts.before(mb, m, phase)
            if m.syncs_before(phase):
                b.sync_stream(COMPUTE, f"{mb}{m.path}.{phase.value} stream synchronize")
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
            self.acts.after(mb, m, phase)

    def _params_of(self, m: ModuleSpec) -> tuple[str, ...]:
        # once per module: every kernel of every micro-step reads the same names, and a
        # module that holds the whole model (the root) has thousands
        names = self.param_names.get(m.path)
        if names is None:
            names = self.param_names[m.path] = tuple(dict.fromkeys(f"param:{p.name}" for p in m.params))
        return names

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
