"""An Adam(W) step on a flat fp32 partition, lowered to IR by implementation.

Which implementation runs is in the DeepSpeed config: with an ``optimizer`` section
DeepSpeed builds its own fused Adam (FusedAdam on GPUs, one kernel reading param, grad,
exp_avg and exp_avg_sq, 16 B, and writing three, 12 B per element); without one the
training script passes a client optimizer, which commsim takes to be PyTorch's AdamW.
That one (torch/optim/adam.py ``_single_tensor_adam``; the ``foreach`` variant makes
the same passes over lists) runs one elementwise pass per operation and allocates two
temporaries for the denominator:

    param.mul_(1 - lr * wd)               read 4, write 4
    exp_avg.lerp_(grad, 1 - beta1)        read 8, write 4
    exp_avg_sq.mul_(beta2)                read 4, write 4
    exp_avg_sq.addcmul_(grad, grad, ...)  read 8, write 4
    t1 = exp_avg_sq.sqrt()                read 4, write 4 (new tensor)
    t2 = t1 / bias_correction2_sqrt       read 4, write 4 (new tensor)
    t2.add_(eps)                          read 4, write 4
    param.addcdiv_(exp_avg, t2, ...)      read 12, write 4

80 B per element instead of 28, and 8 B per element of short-lived allocations.

Run single-tensor (torch's default for CPU tensors), one parameter's eight passes run
back to back on that parameter's rows, so from the fourth on most of what a pass
touches the passes before it just touched (``_TORCH_REUSE``): 44 of the 80 B per
element, within a working set of the parameter's four arrays and two temporaries
(24 B per element). The ops state that (``reuse_bytes``, ``working_set_bytes``); the
``foreach`` variant's passes each stream over every parameter, so its ops state none.
"""

from __future__ import annotations

from commsim.ir import ops as O
from commsim.strategies.builder import ProgramBuilder

IMPLEMENTATIONS = ("fused", "torch")
# torch's AdamW moves 80 B per element where DeepSpeed's CPU Adam, which
# HostCosts.cpu_adam_ps_per_param prices from the host's memory bandwidth, moves 30 B
TORCH_ADAMW_BYTES, CPU_ADAM_BYTES = 80, 30

# (label, flops per element, bytes read, bytes written, allocates the temporary t1/t2)
_TORCH_PASSES = (
    ("weight_decay", 1, 4, 4, None),
    ("exp_avg_lerp", 2, 8, 4, None),
    ("exp_avg_sq_mul", 1, 4, 4, None),
    ("exp_avg_sq_addcmul", 2, 8, 4, None),
    ("denom_sqrt", 1, 4, 4, "t1"),
    ("denom_div", 1, 4, 4, "t2"),
    ("denom_add_eps", 1, 4, 4, None),
    ("param_addcdiv", 2, 12, 4, None),
)
# Single-tensor: bytes per element of each pass that an earlier pass over the same
# parameter touched (_single_tensor_adam's order). weight_decay, the lerp and the
# mul first touch param, exp_avg + grad and exp_avg_sq; the addcmul then reads
# exp_avg_sq and grad and writes exp_avg_sq (12); sqrt reads exp_avg_sq (4) into a
# fresh t1; the division reads t1 (4) into a fresh t2; add_(eps) reads and writes t2
# (8); addcdiv reads param, exp_avg, t2 and writes param (16).
_TORCH_REUSE = {"weight_decay": 0, "exp_avg_lerp": 0, "exp_avg_sq_mul": 0, "exp_avg_sq_addcmul": 12,
                "denom_sqrt": 4, "denom_div": 4, "denom_add_eps": 8, "param_addcdiv": 16}
# param, grad, exp_avg, exp_avg_sq, t1, t2: fp32 each
TORCH_SINGLE_TENSOR_WORKING_SET_BYTES = 24


def adam_step(b: ProgramBuilder, stream: str, label: str, n: int, state: tuple[str, ...], impl: str,
              launch_ns: int, deps: tuple[O.OpId, ...] = (), single_tensor: bool = False) -> None:
    """Adam over ``n`` fp32 elements whose param / exp_avg / exp_avg_sq / grad buffers are
    ``state``; its first kernel waits for ``deps`` (ops of other streams).
    ``single_tensor`` (impl "torch"): the ``n`` elements are one parameter's, whose passes
    run back to back, and the ops state what they reuse."""
    assert impl in IMPLEMENTATIONS, impl
    if impl == "fused":
        b.host("launch", O.HostKind.LAUNCH, launch_ns)
        b.compute(stream, label, O.ComputeKind.OPTIMIZER, 12 * n, 16 * n, 12 * n, deps=deps, buffers=state,
                  in_place_bytes=12 * n)  # param, exp_avg, exp_avg_sq updated where they are
        return
    temps = {"t1": f"{label}.t1", "t2": f"{label}.t2"}
    for name, flops, rd, wr, new in _TORCH_PASSES:
        bufs = state
        if new:
            b.alloc(temps[new], 4 * n, stream, f"{label} {new} (torch AdamW temporary)")
            bufs = state + (temps[new],)
        b.host("launch", O.HostKind.LAUNCH, launch_ns)
        reuse, ws = (_TORCH_REUSE[name] * n, TORCH_SINGLE_TENSOR_WORKING_SET_BYTES * n) if single_tensor else (0, 0)
        # every pass but the two into a fresh temporary writes over an array it read
        b.compute(stream, f"{label}.{name}", O.ComputeKind.OPTIMIZER, flops * n, rd * n, wr * n, deps=deps,
                  buffers=bufs, reuse_bytes=reuse, working_set_bytes=ws, in_place_bytes=0 if new else wr * n)
        deps = ()
        if name == "denom_div":
            b.free(temps["t1"], stream, f"{label} t1")
    b.free(temps["t2"], stream, f"{label} t2")


def torch_adamw(b: ProgramBuilder, stream: str, label: str, params: list[tuple[str, int]], state: tuple[str, ...],
                launch_ns: int, foreach: bool, dtensor_op_ns: int = 0, deps: tuple[O.OpId, ...] = ()) -> None:
    """torch's AdamW over ``params`` ((name, local elements), fp32) whose buffers are
    ``state``. ``foreach`` (``_multi_tensor_adam``, torch's default on GPUs): each pass
    over every parameter's rows at once. Else (``_single_tensor_adam``, on CPUs) one
    parameter's passes, then the next's, each op also paying ``dtensor_op_ns`` (the
    parameters are DTensors)."""
    if foreach:
        adam_step(b, stream, label, sum(k for _, k in params), state, "torch", launch_ns, deps=deps)
        return
    for name, k in params:
        adam_step(b, stream, f"{label}:{name}", k, state, "torch", launch_ns + dtensor_op_ns, deps=deps,
                  single_tensor=True)
        deps = ()


def fp64_norms(b: ProgramBuilder, stream: str, label: str, pieces: list[tuple[str, int]], src: str, dt_bytes: int,
               launch_ns: int, item_each: bool = False) -> None:
    """DeepSpeed's gradient norm (``get_grad_norm_direct`` in stage_1_and_2.py and
    stage3.py): each gradient piece converted to fp64 (zero/utils.py ``get_norm_dtype``)
    in a fresh tensor, then its norm. ``pieces``: (name, elements), read from buffer
    ``src`` holding ``dt_bytes``-byte gradients. ``item_each``: the host reads each
    norm (``.item()``) before the next, as DeepSpeed did before the fused-norm fix."""
    for i, (name, k) in enumerate(pieces):
        tmp = f"{label}.fp64[{i}]"
        b.alloc(tmp, k * 8, stream, f"fp64 copy of {name}'s gradient for its norm")
        b.host("launch", O.HostKind.LAUNCH, launch_ns)
        b.compute(stream, f"{label}:{name}.to_fp64", O.ComputeKind.ELEMENTWISE, k, k * dt_bytes, k * 8,
                  buffers=(src, tmp))
        b.host("launch", O.HostKind.LAUNCH, launch_ns)
        n = b.compute(stream, f"{label}:{name}", O.ComputeKind.ELEMENTWISE, 2 * k, k * 8, 8, buffers=(tmp,))
        b.free(tmp, stream, f"fp64 gradient of {name}")
        if item_each:
            cp = b.copy(stream, f"{label}_item:{name}", O.CopyDirection.D2H, 8, deps=(n,))
            b.sync_ops((cp,), f".item() of {name}'s norm")
