"""FSDP2's two collectives with the copies and buffers around them, lowered to IR ops.

Models torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py (torch 2.13):

* ``foreach_all_gather`` on the all-gather copy-in stream: the all-gather inputs
  (the sharded parameters; with ``MixedPrecisionPolicy.param_dtype`` first cast into a
  flat buffer, ``_get_param_all_gather_inputs``' foreach copy; with CPU offload each
  shard copied host-to-device first, ``FSDPParam.all_gather_inputs``), the output
  buffer (``torch.empty`` of the whole unit, on the copy-in stream), the copy of this
  rank's inputs into its slice (``all_gather_copy_in``); then the all-gather stream
  waits for the copy-in stream and runs ``all_gather_single``;
* ``foreach_all_gather_copy_out`` on the compute (current) stream, after it waits for
  the all-gather: each parameter's unsharded storage allocated
  (``FSDPParam.alloc_all_gather_outputs``) and filled by one ``split_with_sizes_copy``;
* ``foreach_reduce``: on the compute stream the reduce-scatter input (the unit's
  padded size, in the reduce dtype) filled by ``chunk_cat`` (a cast when the gradients'
  dtype differs), the unsharded gradients freed; the reduce-scatter stream waits for
  the compute stream, allocates the output, divides first for fp16
  (``_get_gradient_divide_factors``: fp32 and bf16 use ``ReduceOp.AVG``), runs
  ``reduce_scatter_single``; HSDP then all-reduces the output across the replicas on
  the all-reduce stream; on that last stream the output is divided after (fp16),
  cast to the parameters' dtype when the reduce dtype differs, added into an existing
  sharded gradient (accumulation), or copied to the host (CPU offload).

FSDP2 issues every one of these collectives with ``async_op=False`` (``unshard``'s
default ``unshard_async_op``, ``DefaultReduceScatter``, ``dist.all_reduce``), so c10d
calls ``work.wait()`` before returning. On NCCL that makes the current stream wait and
the host runs on; on a backend that completes collectives on the host (gloo on CPU
tensors) it blocks the calling thread until the collective is done: no prefetch or
reduce-scatter overlaps the next layer's compute there (each is ``blocking``; the
builder's ``host_blocking``).

The state that decides when these run (``FSDPParamGroup``) is in fsdp2.py; these
functions only emit ops and return what the caller keeps.
"""

from __future__ import annotations

from dataclasses import dataclass

from commsim.ir import ops as O
from commsim.strategies.builder import ProgramBuilder
from commsim.strategies.fsdp2_layout import Unit, padded_numel
from commsim.strategies.knobs import HostCosts

COMPUTE = "compute"
COPY_IN = "ag_copy_in"  # FSDPCommContext.all_gather_copy_in_stream
ALL_GATHER = "allgather"  # all_gather_stream
REDUCE_SCATTER = "reduce_scatter"  # reduce_scatter_stream
ALL_REDUCE = "all_reduce"  # all_reduce_stream (HSDP)
AG_STREAMS = (COPY_IN, ALL_GATHER)

DTYPES = {"fp32": O.DType.FP32, "bf16": O.DType.BF16, "fp16": O.DType.FP16}


class Streams:
    """Cross-stream waits (``Stream.wait_event`` / ``wait_stream``) pending for the next
    op each stream runs: CUDA streams are FIFO, so making that op wait holds back every
    later one too."""

    def __init__(self, b: ProgramBuilder):
        self.b = b
        self.pending: dict[str, list[O.OpId]] = {}

    def wait_event(self, streams: tuple[str, ...] | str, op: O.OpId | None) -> None:
        if op is None:
            return
        for s in (streams,) if isinstance(streams, str) else streams:
            self.pending.setdefault(s, []).append(op)

    def wait_stream(self, waiter: str, waited: str) -> None:
        self.wait_event(waiter, self.b.last_on_stream.get(waited))

    def deps(self, stream: str, *extra: O.OpId | None) -> tuple[O.OpId, ...]:
        return tuple(self.pending.pop(stream, ())) + tuple(e for e in extra if e is not None)


@dataclass
class Gathered:
    """An issued all-gather not yet copied out (``AllGatherResult``)."""

    buffer: str  # the output buffer, allocated on the copy-in stream
    op: O.OpId  # the collective (its event)


@dataclass
class Reduced:
    """What ``foreach_reduce`` hands back."""

    rs_input: str  # kept by FSDPCommContext.reduce_scatter_states until recycled
    rs_event: O.OpId
    post_stream: str
    post_event: O.OpId
    grad: str | None  # the new sharded gradient buffer (None: added into the existing one, or offloaded)
    ar_hold: str | None  # HSDP: the reduce-dtype buffer held until the end of backward
    offload_events: tuple[O.OpId, ...]  # non-blocking D2H copies the host waits for at the end of backward


class Comm:
    """Emits one rank's FSDP2 collectives; counts them for unique buffer names."""

    def __init__(self, b: ProgramBuilder, streams: Streams, costs: HostCosts, shard: int, param_dtype: str,
                 reduce_dtype: str, orig_dtype: str, offload: bool, pin_memory: bool):
        self.b, self.streams, self.costs = b, streams, costs
        self.shard = shard  # S: an unsharded parameter's storage is its rows padded to S
        self.pdt, self.rdt, self.odt = DTYPES[param_dtype], DTYPES[reduce_dtype], DTYPES[orig_dtype]
        self.mp = param_dtype != orig_dtype  # FSDPParam.param_dtype is set
        self.offload, self.pin_memory = offload, pin_memory
        self.n_ag = 0
        self.n_rs = 0

    # ------------------------------------------------------------ all-gather
    def all_gather(self, u: Unit, source: str | None, group: tuple[int, ...], label: str) -> Gathered:
        """``foreach_all_gather`` of unit ``u`` over ``group`` from ``source`` (the sharded
        parameters' buffer; None when offloaded to the host, or the post-forward shard)."""
        b, c, s = self.b, self.costs, self.streams
        self.n_ag += 1
        k = self.n_ag
        pb = self.pdt.itemsize_bytes
        n_in = u.padded // len(group)
        inputs: tuple[str, ...] = (source,) if source else ()
        staged = []
        if self.offload and source is None:
            # each shard .to(device, non_blocking=True) (one copy per parameter)
            ob = self.odt.itemsize_bytes
            h2d = f"ag_h2d[{k}]"
            b.alloc(h2d, n_in * ob, COPY_IN, f"{label}: shards copied to the device")
            for _ in u.params:
                b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
            b.copy(COPY_IN, f"{label}.h2d", O.CopyDirection.H2D, n_in * ob, deps=s.deps(COPY_IN), buffers=(h2d,))
            inputs, staged = (h2d,), [h2d]
            if self.mp:  # then _to_dtype_if_needed
                cast = f"ag_cast[{k}]"
                b.alloc(cast, n_in * pb, COPY_IN, f"{label}: shards cast to {self.pdt.value}")
                for _ in u.params:
                    b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
                b.compute(COPY_IN, f"{label}.cast", O.ComputeKind.ELEMENTWISE, n_in, n_in * ob, n_in * pb,
                          buffers=(h2d, cast))
                inputs, staged = (cast,), staged + [cast]
        elif self.mp:
            # the foreach-copy fast path: one flat buffer in param_dtype, one _foreach_copy_
            # (a cast from the sharded parameters, a plain copy from a post-forward shard)
            flat = f"ag_in[{k}]"
            b.alloc(flat, n_in * pb, COPY_IN, f"{label}: all-gather inputs in {self.pdt.value}")
            b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
            if source is not None and source.startswith("pf:"):
                b.copy(COPY_IN, f"{label}.foreach_copy", O.CopyDirection.D2D, n_in * pb, deps=s.deps(COPY_IN),
                       buffers=inputs + (flat,))
            else:
                ob = self.odt.itemsize_bytes
                b.compute(COPY_IN, f"{label}.foreach_cast", O.ComputeKind.ELEMENTWISE, n_in, n_in * ob, n_in * pb,
                          deps=s.deps(COPY_IN), buffers=inputs + (flat,))
            inputs, staged = (flat,), [flat]
        out = f"ag_out[{k}]"
        b.alloc(out, u.padded * pb, COPY_IN, f"{label}: all-gather output")
        b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
        b.copy(COPY_IN, f"{label}.copy_in", O.CopyDirection.D2D, n_in * pb, deps=s.deps(COPY_IN),
               buffers=inputs + (out,))
        for buf in staged:  # del param_all_gather_inputs
            b.free(buf, COPY_IN, f"{label}: all-gather input")
        s.wait_stream(ALL_GATHER, COPY_IN)
        b.host("all_gather launch", O.HostKind.LAUNCH, c.collective_launch_ns)
        op = b.collective(ALL_GATHER, label, O.CollectiveKind.ALL_GATHER, u.padded * pb, self.pdt, group,
                          deps=s.deps(ALL_GATHER), buffers=(out,), blocking=True)
        return Gathered(out, op)

    def copy_out(self, u: Unit, g: Gathered, label: str) -> O.OpId:
        """``foreach_all_gather_copy_out`` on the compute stream; returns the copy (its event)."""
        b, s = self.b, self.streams
        pb = self.pdt.itemsize_bytes
        for p in u.params:  # all_gather_outputs: the rows padded to S, whichever group gathered them
            b.alloc(f"param:{p.name}", padded_numel(p, self.shard) * pb, COMPUTE, f"unsharded {p.name}")
        b.host("launch", O.HostKind.LAUNCH, self.costs.launch_ns)
        return b.copy(COMPUTE, f"{label}.copy_out", O.CopyDirection.D2D, u.padded * pb, deps=s.deps(COMPUTE, g.op),
                      buffers=(g.buffer,) + tuple(f"param:{p.name}" for p in u.params))

    # ------------------------------------------------------------ reduce
    def reduce(self, u: Unit, grads: tuple[str, ...], grad_dtype: O.DType, shard_group: tuple[int, ...],
               replica_group: tuple[int, ...] | None, existing_grad: str | None, label: str) -> Reduced:
        """``foreach_reduce`` of unit ``u``'s unsharded gradients (buffers ``grads``, dtype
        ``grad_dtype``) into its sharded gradient."""
        b, c, s = self.b, self.costs, self.streams
        self.n_rs += 1
        k = self.n_rs
        rdt = self.rdt
        rb, gb = rdt.itemsize_bytes, grad_dtype.itemsize_bytes
        n_shard = u.padded // len(shard_group)
        pre, post, op = divide_factors(rdt, len(shard_group) * (len(replica_group) if replica_group else 1))
        rs_in = f"rs_in[{k}]"
        b.alloc(rs_in, u.padded * rb, COMPUTE, f"{label}: reduce-scatter input")
        b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
        if grad_dtype is rdt:
            b.copy(COMPUTE, f"{label}.chunk_cat", O.CopyDirection.D2D, u.padded * rb, deps=s.deps(COMPUTE),
                   buffers=grads + (rs_in,))
        else:
            b.compute(COMPUTE, f"{label}.chunk_cat", O.ComputeKind.ELEMENTWISE, u.numel, u.numel * gb, u.padded * rb,
                      deps=s.deps(COMPUTE), buffers=grads + (rs_in,))
        for g in grads:  # unsharded_grads.clear()
            b.free(g, COMPUTE, f"{label}: unsharded gradient")
        s.wait_stream(REDUCE_SCATTER, COMPUTE)
        rs_out = f"rs_out[{k}]"
        b.alloc(rs_out, n_shard * rb, REDUCE_SCATTER, f"{label}: reduce-scatter output")
        if pre:
            b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
            b.compute(REDUCE_SCATTER, f"{label}.predivide", O.ComputeKind.ELEMENTWISE, u.padded, u.padded * rb,
                      u.padded * rb, deps=s.deps(REDUCE_SCATTER), buffers=(rs_in,))
        b.host("reduce_scatter launch", O.HostKind.LAUNCH, c.collective_launch_ns)
        rs_event = b.collective(REDUCE_SCATTER, label, O.CollectiveKind.REDUCE_SCATTER, u.padded * rb, rdt,
                                shard_group, reduce_op=op, deps=s.deps(REDUCE_SCATTER), buffers=(rs_in, rs_out),
                                blocking=True)
        post_stream = REDUCE_SCATTER
        ar_hold = None
        if replica_group is not None:
            s.wait_stream(ALL_REDUCE, REDUCE_SCATTER)
            b.host("all_reduce launch", O.HostKind.LAUNCH, c.collective_launch_ns)
            b.collective(ALL_REDUCE, label.replace(".rs", ".ar", 1), O.CollectiveKind.ALL_REDUCE, n_shard * rb, rdt,
                         replica_group, reduce_op=op, deps=s.deps(ALL_REDUCE), buffers=(rs_out,), blocking=True)
            post_stream = ALL_REDUCE
        if post:
            b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
            b.compute(post_stream, f"{label}.postdivide", O.ComputeKind.ELEMENTWISE, n_shard, n_shard * rb,
                      n_shard * rb, deps=s.deps(post_stream), buffers=(rs_out,))
        grad = rs_out
        if rdt is not self.odt:
            # _to_dtype_if_needed(reduce_output, orig_dtype): a new tensor; the reduce-dtype
            # output is then dropped, except under HSDP, where _all_reduce_state holds it
            # to the end of backward
            ob = self.odt.itemsize_bytes
            grad = f"grad32[{k}]"
            b.alloc(grad, n_shard * ob, post_stream, f"{label}: sharded gradient in {self.odt.value}")
            b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
            b.compute(post_stream, f"{label}.to_orig_dtype", O.ComputeKind.ELEMENTWISE, n_shard, n_shard * rb,
                      n_shard * ob, deps=s.deps(post_stream), buffers=(rs_out, grad))
            if replica_group is not None:
                ar_hold = rs_out
            else:
                b.free(rs_out, REDUCE_SCATTER, f"{label}: reduce-dtype output")
        offload_events: tuple[O.OpId, ...] = ()
        gb_orig = self.odt.itemsize_bytes
        if self.offload:
            # each sharded gradient .to("cpu"), non-blocking only with pinned memory and
            # nothing to accumulate into; the device copy is then dropped
            non_blocking = self.pin_memory and existing_grad is None
            for _ in u.params:
                b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
            cp = b.copy(post_stream, f"{label}.d2h", O.CopyDirection.D2H, u.local * gb_orig,
                        deps=s.deps(post_stream), buffers=(grad,))
            b.free(grad, post_stream if grad.startswith("grad32") else REDUCE_SCATTER, f"{label}: device gradient")
            if non_blocking:
                offload_events = (cp,)
            else:
                b.sync_ops((cp,), f"{label}: blocking copy of the gradient to the host")
                if existing_grad is not None:  # the CPU add of the accumulation
                    b.host(f"{label}: accumulate on the host", O.HostKind.OPTIMIZER,
                           u.local * c.cpu_adam_ps_per_param * 12 // 30 // 1000)
            grad = None
        elif existing_grad is not None:
            b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
            b.compute(post_stream, f"{label}.accumulate", O.ComputeKind.ELEMENTWISE, n_shard, 2 * n_shard * gb_orig,
                      n_shard * gb_orig, deps=s.deps(post_stream), buffers=(existing_grad, grad))
            b.free(grad, post_stream if grad.startswith("grad32") else REDUCE_SCATTER, f"{label}: added")
            grad = None
        post_event = b.last_on_stream[post_stream]
        return Reduced(rs_in, rs_event, post_stream, post_event, grad, ar_hold, offload_events)


def divide_factors(reduce_dtype: O.DType, data_parallel: int) -> tuple[float | None, float | None, O.ReduceOp]:
    """(pre-divide factor, post-divide factor, reduce op), as ``_get_gradient_divide_factors``
    for the default divide factor: fp32 and bf16 reduce with AVG (no division kernels);
    fp16 sums, dividing by a power of two near sqrt(N) before and by the rest after, to
    stay in range. A factor of 1 (``_div_if_needed`` skips it) is None."""
    if reduce_dtype is not O.DType.FP16:
        return None, None, O.ReduceOp.AVG if data_parallel > 1 else O.ReduceOp.SUM
    pre = 1
    while data_parallel % pre == 0 and data_parallel / pre > pre:
        pre *= 2
    post = data_parallel / pre
    return (float(pre) if pre != 1 else None), (post if post != 1 else None), O.ReduceOp.SUM
