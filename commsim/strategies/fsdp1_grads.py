"""FSDP1's gradients after a unit's backward, lowered to IR: the mixin ``FSDP1Lowering``
(fsdp1.py) reduces each unit's flat gradient with, and the optimizer step over them.

On ``post_backward``, after it waits for the default stream (torch 2.13's ``_reduce_grad``,
_runtime_utils.py RU:830-886): the gradient cast to the reduce dtype when it differs,
padded to the padded size P when P > N (``F.pad``), divided by the pre-divide factor,
reduce-scattered into a new shard; HSDP then all-reduces the shard across the replicas
on ``all_reduce``; the post-divide; the cast to fp32 (``_cast_grad_to_param_dtype``);
and, from a later micro-step on, the add into the shard kept from the earlier ones
(``_accumulate_sharded_grad``, RU:906-928). The temporaries and the flat gradient are
freed as their last references go. NO_SHARD all-reduces the whole gradient instead
(``_reduce_grad_no_shard``). Then torch's AdamW over the flat parameters in
``model.parameters()``' order, and ``zero_grad`` dropping the gradients in that order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from commsim.ir import ops as O
from commsim.ir.ops import Phase
from commsim.strategies.optimizer import torch_adamw

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


class FSDP1Gradients:
    """The gradient half of ``FSDP1Lowering``; the attributes it reads are that class's."""

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

    def _reduce_no_shard(self, h: _Handle, flat: str) -> None:
        """NO_SHARD (``_reduce_grad_no_shard``, RU:931-949): the flat gradient, cast to the
        reduce dtype when it differs, pre-divided, all-reduced in place over every rank,
        post-divided, cast to fp32 when it is not; that is the unsharded ``.grad`` the
        optimizer reads. Autograd's own gradient goes as the hook returns, unless it is it."""
        b, c, s = self.b, self.costs, self.streams
        n, rb = h.unit.numel, self.rdt.itemsize_bytes
        label = f"{self.mb}bwd.ar:{h.name}"
        s.wait_stream(POST_BACKWARD, COMPUTE)
        grad, stream = flat, COMPUTE
        if self.rdt is not self.cdt:  # .grad.data = .grad.to(reduce_dtype) (RU:756-764)
            grad, stream = f"{label}.cast", POST_BACKWARD
            b.alloc(grad, n * rb, POST_BACKWARD, f"{h.name}'s gradient in {self.rdt.value}")
            self._side(POST_BACKWARD, f"{label}.to_reduce_dtype", n, n * self.cdt.itemsize_bytes, n * rb,
                       (flat, grad))
        pre = predivide_factor(self.world)
        if pre > 1:
            self._side(POST_BACKWARD, f"{label}.predivide", n, n * rb, n * rb, (grad,))
        b.host("all_reduce launch", O.HostKind.LAUNCH, c.collective_launch_ns)
        b.collective(POST_BACKWARD, label, O.CollectiveKind.ALL_REDUCE, n * rb, self.rdt, self.shard_group,
                     reduce_op=O.ReduceOp.SUM, deps=s.deps(POST_BACKWARD), buffers=(grad,), blocking=True)
        if self.world / pre > 1:
            self._side(POST_BACKWARD, f"{label}.postdivide", n, n * rb, n * rb, (grad,))
        if self.rdt is not FP32:  # _cast_grad_to_param_dtype (RU:1030-1056)
            grad32 = f"{self.mb}grad32:{h.name}"
            b.alloc(grad32, n * 4, POST_BACKWARD, f"{h.name}'s gradient in fp32")
            self._side(POST_BACKWARD, f"{label}.to_fp32", n, n * rb, n * 4, (grad, grad32))
            if grad != flat:
                b.free(grad, POST_BACKWARD, f"{h.name}'s gradient in {self.rdt.value}")
            grad, stream = grad32, POST_BACKWARD
        if grad != flat:
            b.free(flat, COMPUTE, f"flat gradient of {h.name}")
        h.grad, h.grad_stream = grad, stream

    def _side(self, stream: str, label: str, n: int, read: int, written: int, buffers: tuple[str, ...]) -> None:
        self.b.host("launch", O.HostKind.LAUNCH, self.costs.launch_ns)
        self.b.compute(stream, label, O.ComputeKind.ELEMENTWISE, n, read, written, deps=self.streams.deps(stream),
                       buffers=buffers)

    # ------------------------------------------------------------ optimizer
    def _optimizer(self) -> None:
        b, c = self.b, self.costs
        b.phase = Phase.OPTIMIZER
        # model.parameters()' order: the root's flat parameter is the root module's own,
        # listed before its children's (_unshard_param_utils.py:89-101)
        params = [self.root] + self.handles[:-1]
        state = tuple(f"shard:{h.name}" for h in params) + ("exp_avg", "exp_avg_sq") + \
            tuple(h.grad for h in params if h.grad)
        deps = self.streams.deps(COMPUTE)
        torch_adamw(b, COMPUTE, "optimizer.adamw", [(h.name, h.shard) for h in params], state, c.launch_ns,
                    self.foreach, deps=deps)
        for h in params:  # zero_grad(set_to_none=True), in the same order (optim/optimizer.py:1058-1062)
            if h.grad is not None:
                b.free(h.grad, h.grad_stream, f"sharded gradient of {h.name}")
                h.grad = None
