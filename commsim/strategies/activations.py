"""Activation memory of a lowered step, as autograd allocates it: what each module's
forward keeps for backward, each checkpointed layer's input, and in backward the
activation gradients and kernel temporaries between the parameter gradients.

``Activations`` is used by every generator (ZeRO-1/2, ZeRO-3, FSDP2) on its compute
stream, around each module's kernels (``before`` / ``after``, in forward, recompute and
backward):

* forward: what the module keeps (``ModuleSpec.activation_bytes``) is allocated; with
  layer-wise checkpointing a layer keeps only its input (allocated by its first
  module), and its modules' activations are freed right after them;
* recompute: a checkpointed layer's activations are made again;
* backward (``models.grad_memory``): the gradient of the module's input and its kernel
  chain's temporaries are allocated; after its kernels the temporaries, the gradient
  it received (the previous module's input gradient, now consumed) and its
  activations are freed, and the layer's kept input after its first module. The last
  gradient is freed when backward ends (``end_backward``). A recompute between two
  modules' backward leaves the received gradient alive, as autograd does.

Buffers are named per micro-step (``mb``) so that the kernels that use them can list
them, as the allocator model needs.
"""

from __future__ import annotations

from commsim.ir.ops import Phase
from commsim.models.grad_memory import backward_memory
from commsim.models.spec import ModelDescription, ModuleSpec
from commsim.strategies.builder import ProgramBuilder


class Activations:
    """One step's activation buffers on one stream."""

    def __init__(self, b: ProgramBuilder, md: ModelDescription, stream: str, checkpointing: bool):
        self.b, self.md, self.stream, self.checkpointing = b, md, stream, checkpointing
        # each checkpointed layer's first module with forward kernels (not its container):
        # it allocates the kept layer input
        self.block_first: dict[int, str] = {}
        for m in md.modules:
            if m.block is not None and m.fwd:
                self.block_first.setdefault(m.block, m.path)
        self.carried: str | None = None  # the gradient the next module's backward receives

    def _first_of_block(self, m: ModuleSpec) -> bool:
        return self.checkpointing and m.block is not None and self.block_first.get(m.block) == m.path

    def ckpt_bytes(self, first: ModuleSpec) -> int:
        """A layer's input: tokens x hidden, or what the layer's first module writes."""
        if self.md.arch is not None:
            return self.md.tokens * self.md.arch.hidden * self.md.dtype_bytes
        return max(1, sum(k.bytes_written for k in first.fwd))

    def before(self, mb: str, m: ModuleSpec, phase: Phase) -> tuple[str, ...]:
        """Allocations before ``m``'s kernels of ``phase``; the buffers the kernels use."""
        act = f"{mb}act:{m.path}"
        used: tuple[str, ...] = (act,) if m.fwd and m.activation_bytes else ()
        if phase is Phase.BACKWARD:
            return used + (self._grads_before(mb, m) if m.bwd else ())
        if not m.fwd:
            return ()
        if phase is Phase.FORWARD and self._first_of_block(m):
            self.b.alloc(f"{mb}ckpt:{m.block}", self.ckpt_bytes(m), self.stream,
                         f"checkpointed input of layer {m.block}")
        if m.activation_bytes:  # a module whose outputs autograd does not keep has none
            self.b.alloc(act, m.activation_bytes, self.stream, f"activation {m.path}")
        return used

    def after(self, mb: str, m: ModuleSpec, phase: Phase) -> None:
        """Frees after ``m``'s kernels of ``phase``."""
        if phase is Phase.BACKWARD and m.bwd:
            self._grads_after(mb, m)
        if not m.fwd:
            return
        act = f"{mb}act:{m.path}"
        if phase is Phase.FORWARD and self.checkpointing and m.block is not None:
            if m.activation_bytes:
                self.b.free(act, self.stream, "activation not kept (checkpointed layer)")
        elif phase is Phase.BACKWARD:
            if m.activation_bytes:
                self.b.free(act, self.stream, "activation consumed by backward")
            if self._first_of_block(m):
                self.b.free(f"{mb}ckpt:{m.block}", self.stream, f"checkpointed input of layer {m.block}")

    def end_backward(self) -> None:
        """The end of backward: the embeddings' input gradient goes nowhere."""
        if self.carried:
            self.b.free(self.carried, self.stream, "activation gradient consumed")
            self.carried = None

    # ------------------------------------------------------------ activation gradients
    def _grads_before(self, mb: str, m: ModuleSpec) -> tuple[str, ...]:
        mem = backward_memory(m)
        received = (self.carried,) if self.carried else ()
        if not mem.grad_input_bytes:
            return received
        gin = f"{mb}agrad:{m.path}"
        self.b.alloc(gin, mem.grad_input_bytes, self.stream, f"gradient of {m.path}'s input")
        used = (gin,) + received
        if mem.temp_bytes:
            self.b.alloc(f"{mb}atmp:{m.path}", mem.temp_bytes, self.stream, f"temporaries of {m.path}'s backward")
            used += (f"{mb}atmp:{m.path}",)
        return used

    def _grads_after(self, mb: str, m: ModuleSpec) -> None:
        mem = backward_memory(m)
        if not mem.grad_input_bytes:
            return
        if mem.temp_bytes:
            self.b.free(f"{mb}atmp:{m.path}", self.stream, "backward temporaries")
        if self.carried:
            self.b.free(self.carried, self.stream, "activation gradient consumed")
        self.carried = f"{mb}agrad:{m.path}"
