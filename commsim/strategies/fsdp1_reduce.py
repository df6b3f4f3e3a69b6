"""FSDP1's gradient reduction in a unit's post-backward hook (torch 2.13's ``_reduce_grad``),
lowered to IR: the mixin ``FSDP1Lowering`` (fsdp1.py) reduces each unit's flat gradient with.

On ``post_backward``, after it waits for the default stream: the gradient cast to the
reduce dtype when it differs, padded to the padded size P when P > N (``F.pad``),
divided by the pre-divide factor, reduce-scattered into a new shard; HSDP then
all-reduces the shard across the replicas on ``all_reduce`` (_runtime_utils.py
RU:830-886); the post-divide; the cast to fp32 (``_cast_grad_to_param_dtype``); and,
from a later micro-step on, the add into the shard kept from the earlier ones
(``_accumulate_sharded_grad``, RU:906-928). The temporaries and the flat gradient are
freed as their last references go.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from commsim.ir import ops as O

if TYPE_CHECKING:
    from commsim.strategies.fsdp1 import _Handle

COMPUTE, POST_BACKWARD, ALL_REDUCE = "compute", "post_backward", "all_reduce"
FP32 = O.DType.FP32


def predivide_factor(world: int) -> int:
    """``DefaultState._get_gradient_predivide_factor`` (algorithms/_comm_hooks/
    default_hooks.py:38-42, called at _init_utils.py:131-138): f doubled from 1 while it
    divides the data-parallel world and world / f > f; world / f is divided after."""
    f = 1
    while world % f == 0 and world / f > f:
        f *= 2
    return f


class FSDP1Reduction:
    """The reduction half of ``FSDP1Lowering``; the attributes it reads are that class's."""

    def _reduce(self, h: _Handle, flat: str) -> None:
        b, c, s = self.b, self.costs, self.streams
        n, p, k = h.unit.numel, h.padded, h.shard
        rb = self.rdt.itemsize_bytes
        label = f"{self.mb}bwd.rs:{h.name}"
        s.wait_stream(POST_BACKWARD, COMPUTE)
        src, temps = flat, []
        if self.rdt is not self.cdt:
            cast = f"{label}.cast"
            b.alloc(cast, n * rb, POST_BACKWARD, f"{h.name}'s gradient in {self.rdt.value}")
            self._side(POST_BACKWARD, f"{label}.to_reduce_dtype", n, n * self.cdt.itemsize_bytes, n * rb, (src, cast))
            src = cast
            temps.append(cast)
        if p > n:  # F.pad to the padded size
            pad = f"{label}.pad"
            b.alloc(pad, p * rb, POST_BACKWARD, f"{h.name}'s gradient padded to {p}")
            self._side(POST_BACKWARD, f"{label}.pad", p, n * rb, p * rb, (src, pad))
            src = pad
            temps.append(pad)
        out = f"{self.mb}sgrad:{h.name}"
        b.alloc(out, k * rb, POST_BACKWARD, f"{h.name}'s reduced gradient shard")
        world = self.world
        pre = predivide_factor(world)
        post = world / pre
        if pre > 1:
            self._side(POST_BACKWARD, f"{label}.predivide", p, p * rb, p * rb, (src,))
        b.host("reduce_scatter launch", O.HostKind.LAUNCH, c.collective_launch_ns)
        b.collective(POST_BACKWARD, label, O.CollectiveKind.REDUCE_SCATTER, p * rb, self.rdt, self.shard_group,
                     reduce_op=O.ReduceOp.SUM, deps=s.deps(POST_BACKWARD), buffers=(src, out), blocking=True)
        stream = POST_BACKWARD
        if self.replica_group is not None:  # HSDP: across the replicas, on its own stream
            s.wait_stream(ALL_REDUCE, POST_BACKWARD)
            b.host("all_reduce launch", O.HostKind.LAUNCH, c.collective_launch_ns)
            b.collective(ALL_REDUCE, f"{self.mb}bwd.ar:{h.name}", O.CollectiveKind.ALL_REDUCE, k * rb, self.rdt,
                         self.replica_group, reduce_op=O.ReduceOp.SUM, deps=s.deps(ALL_REDUCE), buffers=(out,),
                         blocking=True)
            stream = ALL_REDUCE
        if post > 1:
            self._side(stream, f"{label}.postdivide", k, k * rb, k * rb, (out,))
        if self.rdt is not FP32:  # the sharded gradient in the flat parameter's dtype
            grad = f"{self.mb}sgrad32:{h.name}"
            b.alloc(grad, k * 4, stream, f"{h.name}'s gradient shard in fp32")
            self._side(stream, f"{label}.to_fp32", k, k * rb, k * 4, (out, grad))
            b.free(out, POST_BACKWARD, f"{h.name}'s reduced shard in {self.rdt.value}")
            out = grad
        accumulate = h.grad is not None
        if accumulate:  # a later micro-step: _saved_grad_shard += the new shard (_accumulate_sharded_grad)
            self._side(stream, f"{label}.accumulate", k, 2 * k * 4, k * 4, (h.grad, out))
        # _reduce_grad's locals go as it returns, in their order (the cast and padded
        # gradients, then the new shard unless kept); the flat gradient as the hook returns
        for t in temps:
            b.free(t, POST_BACKWARD, "reduce-scatter temporary")
        if accumulate:
            b.free(out, stream, f"{h.name}'s new gradient shard (accumulated)")
        else:
            h.grad, h.grad_stream = out, stream
        b.free(flat, COMPUTE, f"flat gradient of {h.name}")

    def _side(self, stream: str, label: str, n: int, read: int, written: int, buffers: tuple[str, ...]) -> None:
        self.b.host("launch", O.HostKind.LAUNCH, self.costs.launch_ns)
        self.b.compute(stream, label, O.ComputeKind.ELEMENTWISE, n, read, written, deps=self.streams.deps(stream),
                       buffers=buffers)
