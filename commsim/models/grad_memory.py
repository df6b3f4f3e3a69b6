"""The memory a module's backward allocates beyond parameter gradients: the gradient it
hands to the module before it, and the temporaries of its kernel chain.

Autograd runs a module's backward as a chain of kernels: each reads the gradient the
previous one wrote (and saved tensors) and writes a new one, and the engine frees a
gradient once the node that consumed it has run. So while kernel i runs, the gradient
the module received, kernel i-1's output and kernel i's output are alive; the last
kernel's output is the gradient of the module's input, which lives until the module
before it (in forward order) has consumed it. Kernels that write a parameter's gradient
(the weight and bias GEMMs and reductions, an embedding's dense gradient) are not part
of the chain: the strategies allocate parameter gradients themselves (ZeRO's buckets,
FSDP2's unsharded gradients).

Per module this gives two sizes (``BackwardMemory``): ``grad_input_bytes``, allocated
with the module's backward and freed after the next module's backward, and
``temp_bytes``, the chain's peak beyond the received gradient and ``grad_input_bytes``,
allocated for the module's backward only. ``backward_live_bytes`` replays them over a
list of modules with the saved activations each module's backward releases: the peak
that a one-layer check against ``torch.profiler``'s memory timeline on CPU measures
(tests/models/test_hf_memory.py).

Where it is coarser than autograd: a saved tensor is freed after the backward of the
module that made it (``ModuleSpec.saved_bytes`` counts it there), while autograd frees
it after the last node that saved it, which can be the next module; and branches (a
product's two gradients, a residual's sum) are taken as the chain's neighbours. Both
err high, never low, in the three families checked.
"""

from __future__ import annotations

from dataclasses import dataclass

from commsim.models.spec import Kernel, ModuleSpec

# Kernels that write a parameter's gradient, by name (transformer.py / families.py /
# eager.py): a GEMM's weight gradient, a bias or norm weight's reduction, an embedding's
# dense gradient (and its tied copy's accumulation).
# DeepSpeed's transformer kernel (bing_bert.py) names them "<gemm>.wgrad", "<gemm>.bias_grad"
# and "<norm>.gamma_beta": matched by their last part.
PARAM_GRAD_KERNELS = frozenset({"wgrad", "bias_grad", "weight_grad.sum", "lookup_bwd", "tied_grad"})
PARAM_GRAD_SUFFIXES = frozenset({"wgrad", "bias_grad", "gamma_beta"})


@dataclass(frozen=True, slots=True)
class BackwardMemory:
    """What one module's backward allocates besides parameter gradients."""

    grad_input_bytes: int  # the gradient of the module's input: kept for the module before it
    temp_bytes: int  # the kernel chain's peak beyond the received gradient and grad_input_bytes


def writes_param_grad(k: Kernel, m: ModuleSpec) -> bool:
    """A kernel whose output is a parameter's gradient: by name, or an output shaped like
    one of the module's parameters (walked modules name their kernels fwd / bwd)."""
    if k.name in PARAM_GRAD_KERNELS or k.name.rsplit(".", 1)[-1] in PARAM_GRAD_SUFFIXES:
        return True
    shapes = {p.shape for p in m.params} | {tuple(reversed(p.shape)) for p in m.params}
    return bool(k.shape) and tuple(k.shape) in shapes


def backward_memory(m: ModuleSpec) -> BackwardMemory:
    """The chain's sizes for ``m``'s backward (zeros for a module without one)."""
    outs = [k.bytes_written for k in m.bwd if not writes_param_grad(k, m)]
    if not outs:
        return BackwardMemory(0, 0)
    pair_peak = max(a + b for a, b in zip([0] + outs, outs))
    return BackwardMemory(outs[-1], max(0, pair_peak - outs[-1]))


def backward_live_bytes(modules: tuple[ModuleSpec, ...] | list[ModuleSpec]) -> tuple[int, int]:
    """Replays the backward of ``modules`` (forward order; run in reverse) from the
    moment the gradient of their output exists (held by the caller: never freed here),
    with every module's saved activations alive: returns (peak, end) of the live bytes
    relative to that moment, parameter gradients excluded. Each module allocates its
    input gradient and temporaries, runs, then frees the temporaries, the gradient it
    received (if the replay made it) and its saved activations."""
    live = peak = carried = 0
    for m in reversed(list(modules)):
        mem = backward_memory(m)
        if mem.grad_input_bytes:
            live += mem.grad_input_bytes + mem.temp_bytes
            peak = max(peak, live)
            live -= mem.temp_bytes + carried
            carried = mem.grad_input_bytes
        live -= m.activation_bytes if m.fwd else 0
        peak = max(peak, live)
    return peak, live
