"""A model description from real code: walk a ``torch.nn.Module`` on the meta device.

``describe_module("pkg.mod:function", micro_batch, seq_len)`` builds the module under
``torch.device("meta")`` (no memory), runs one forward pass on meta token ids with
hooks on every submodule, and records what ZeRO-3's hooks would see: the submodule
tree in pre-forward order (containers included, with how many modules each encloses),
each module's own parameters (tied parameters under one name), ``named_parameters()``
order, and the kernels each module runs: matmuls with their shapes, every other op as
memory traffic. Work a container does between its children (e.g. attention scores in
a self-attention module) is charged to the next child that starts inside it, or else
to its last child, since kernels belong to leaves in the description. Backward kernels
are derived from forward ones (a matmul's two gradient matmuls, elementwise ops twice
the traffic), as the catalogue does.

torch is imported only when a module is walked, so ``commsim`` itself imports without it.
"""

from __future__ import annotations

import importlib
import re
from typing import TYPE_CHECKING, Any, Callable

from commsim.ir.errors import CommsimInputError
from commsim.ir.ops import ComputeKind, GemmShape
from commsim.models.spec import Kernel, ModelDescription, ModuleKind, ModuleSpec, ParamSpec, Role

if TYPE_CHECKING:  # torch is imported where a module is walked: commsim imports without it
    from torch import nn

_GEMM = {"aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default"}
_VIEWS = re.compile(r"aten\.(view|_unsafe_view|t|transpose|permute|unsqueeze|squeeze|expand|detach|alias|"
                    r"reshape|as_strided|slice|select|split|_reshape_alias|lift_fresh|clone)\b")


def load_factory(spec: str) -> Callable[[], "nn.Module"]:
    mod_name, sep, fn_name = spec.partition(":")
    if not sep or not mod_name or not fn_name:
        raise CommsimInputError(f"--model {spec!r}: expected module:function (a function returning the nn.Module)")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise CommsimInputError(f"--model {spec!r}: cannot import {mod_name}: {e}") from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise CommsimInputError(f"--model {spec!r}: {mod_name} has no function {fn_name}")
    return fn


def _bytes(x: Any) -> int:
    import torch

    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_bytes(t) for t in x)
    return 0


def _gemm(name: str, args: tuple) -> GemmShape:
    if name in ("aten.mm.default", "aten.addmm.default"):
        a, b = (args[1], args[2]) if name.endswith("addmm.default") else (args[0], args[1])
        return GemmShape(a.shape[0], b.shape[1], a.shape[1])
    a, b = (args[1], args[2]) if name.endswith("baddbmm.default") else (args[0], args[1])
    return GemmShape(a.shape[1], b.shape[2], a.shape[2], a.shape[0])


def _capture(walker: "_Walker") -> Any:
    """A dispatch mode that charges every aten op the model runs to the walker."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Capture(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
            out = func(*args, **(kwargs or {}))
            name = str(func)
            if name in _GEMM:
                g = _gemm(name, args)
                k = Kernel("fwd", ComputeKind.GEMM, g.flops, _bytes(args), _bytes(out), g)
            elif _VIEWS.match(name):
                return out
            else:
                n = out.numel() if isinstance(out, torch.Tensor) else 0
                k = Kernel("fwd", ComputeKind.ELEMENTWISE, n, _bytes(args), _bytes(out))
            walker.charge(k)
            return out

    return _Capture()


class _Walker:
    def __init__(self, model: "nn.Module"):
        self.model = model
        self.order: list[str] = []  # pre-forward order
        self.encloses: dict[str, int] = {}
        self.kernels: dict[str, list[Kernel]] = {}
        self.stack: list[str] = []
        self.started: dict[str, int] = {}
        self.pending: dict[str, list[Kernel]] = {}
        self.last_leaf_in: dict[str, str] = {}
        self.children = {name: bool(list(m.children())) for name, m in model.named_modules()}

    def pre(self, name: str) -> None:
        # work the enclosing container did since its last child goes to this module
        if self.stack and self.pending.get(self.stack[-1]):
            self.kernels.setdefault(name, []).extend(self.pending.pop(self.stack[-1]))
        self.started[name] = len(self.order)
        self.order.append(name)
        self.stack.append(name)

    def post(self, name: str) -> None:
        assert self.stack and self.stack[-1] == name, (self.stack, name)
        self.stack.pop()
        self.encloses[name] = len(self.order) - self.started[name] - 1
        leftover = self.pending.pop(name, [])
        if leftover:  # container work after its last child: charge that child
            target = self.last_leaf_in.get(name, name)
            self.kernels.setdefault(target, []).extend(leftover)
        if not self.children.get(name, False):
            for parent in self.stack:
                self.last_leaf_in[parent] = name

    def charge(self, k: Kernel) -> None:
        if not self.stack:
            return
        top = self.stack[-1]
        if self.children.get(top, False):
            self.pending.setdefault(top, []).append(k)
        else:
            self.kernels.setdefault(top, []).append(k)


def _backward(k: Kernel) -> tuple[Kernel, ...]:
    if k.kind is ComputeKind.GEMM and k.gemm is not None:
        g = k.gemm
        return (Kernel("dgrad", ComputeKind.GEMM, g.flops, k.bytes_written + k.bytes_read // 2, k.bytes_read // 2,
                       GemmShape(g.m, g.k, g.n, g.batch)),
                Kernel("wgrad", ComputeKind.GEMM, g.flops, k.bytes_written + k.bytes_read // 2, k.bytes_read // 2,
                       GemmShape(g.k, g.n, g.m, g.batch)))
    return (Kernel("bwd", k.kind, 2 * k.flops, k.bytes_read + k.bytes_written, k.bytes_read),)


def _kind_role(m: "nn.Module", name: str) -> tuple[ModuleKind, Role]:
    from torch import nn

    if isinstance(m, nn.Embedding):
        return ModuleKind.EMBEDDING, Role.EMBEDDING
    if isinstance(m, nn.Linear):
        return ModuleKind.LINEAR, Role.OTHER
    if "norm" in type(m).__name__.lower() or "norm" in name.lower():
        return ModuleKind.NORM, Role.NORM
    return ModuleKind.OTHER, Role.OTHER if any(True for _ in m.parameters(recurse=False)) else Role.NONE


def _block(name: str) -> int | None:
    for part in name.split("."):
        if part.isdigit():
            return int(part)
    return None


def describe_module(factory: str | Callable[[], "nn.Module"], micro_batch: int, seq_len: int, dtype_bytes: int = 2,
                    vocab_hint: int | None = None, name: str | None = None) -> ModelDescription:
    """Walk the module a factory returns; inputs are (micro_batch, seq_len) token ids."""
    import torch
    from torch import nn

    fn = load_factory(factory) if isinstance(factory, str) else factory
    with torch.device("meta"):
        model = fn()
    if not isinstance(model, nn.Module):
        raise CommsimInputError(f"--model {factory!r}: the function returned {type(model).__name__}, not an nn.Module")
    walker = _Walker(model)
    handles = []
    for mod_name, mod in model.named_modules():
        handles.append(mod.register_forward_pre_hook(lambda _m, _a, n=mod_name: walker.pre(n)))
        handles.append(mod.register_forward_hook(lambda _m, _a, _o, n=mod_name: walker.post(n)))
    ids = torch.zeros(micro_batch, seq_len, dtype=torch.long, device="meta")
    try:
        with torch.no_grad(), _capture(walker):
            model(ids)
    finally:
        for h in handles:
            h.remove()
    canonical: dict[int, str] = {}
    for pname, p in model.named_parameters():
        canonical.setdefault(id(p), pname)
    modules_by_name = dict(model.named_modules())
    scale = dtype_bytes / 4  # meta tensors are fp32 here; the run's 16-bit traffic is half
    specs = []
    for mod_name in walker.order:
        m = modules_by_name[mod_name]
        params = tuple(ParamSpec(canonical[id(p)], tuple(p.shape)) for p in m.parameters(recurse=False))
        fwd = tuple(Kernel(k.name, k.kind, k.flops, int(k.bytes_read * scale), int(k.bytes_written * scale), k.gemm)
                    for k in walker.kernels.get(mod_name, []))
        bwd = tuple(b for k in reversed(fwd) for b in _backward(k))
        kind, role = _kind_role(m, mod_name)
        specs.append(ModuleSpec(mod_name, kind, role, params, _block(mod_name), fwd, bwd,
                                walker.encloses.get(mod_name, 0)))
    order = tuple(dict.fromkeys(canonical[id(p)] for _, p in model.named_parameters()))
    label = name or (factory if isinstance(factory, str) else getattr(fn, "__name__", "module"))
    return ModelDescription(label, tuple(specs), micro_batch, seq_len, dtype_bytes, None, order)
