"""The ATen calls behind the megatron_gpt family's attention core, run on CPU.

Megatron's attention (megatron-core 0.3.0 dot_product_attention.py, the 2021 code's
successor) calls, on the [s, b, 3h] projection output: views into q, k, v; ``baddbmm``
into a new tensor with beta 0 and alpha on transposed views; the softmax (a fused CUDA
kernel there; ``softmax`` stands in on CPU); dropout; ``bmm`` on the value's transposed
view; ``permute(2, 0, 1, 3).contiguous()``. These calls are written here (not Megatron's
code) and run under a dispatch logger, forward and backward, to check what the family's
kernel list assumes of PyTorch: no copies before the batched GEMMs, baddbmm's backward
two bmm each followed by a multiply by alpha, the context copy's backward no copy, and
the q / k / v split's backward one concatenation.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from commsim.models.eager import PYTORCH_1_10  # noqa: E402
from commsim.models.megatron_gpt import _Kernels  # noqa: E402
from commsim.models.transformer import Builder, TransformerConfig  # noqa: E402

VIEWS = {"view", "_unsafe_view", "t", "transpose", "expand", "permute", "unsqueeze", "squeeze", "slice", "select",
         "split", "split_with_sizes", "alias", "detach", "_reshape_alias", "as_strided", "empty", "empty_like",
         "lift_fresh", "ones_like", "zeros_like", "new_empty_strided", "empty_strided"}


class Calls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._opname not in VIEWS:
            self.names.append(func._opname)
        return func(*args, **(kwargs or {}))


def test_attention_core_calls():
    s, b, nh, hn, layer = 16, 2, 4, 8, 3
    h = nh * hn
    B = b * nh
    torch.manual_seed(0)
    mixed = torch.randn(s, b, 3 * h, requires_grad=True)  # the QKV projection's output
    with Calls() as fwd:
        x = mixed.view(s, b, nh, 3 * hn)
        q, k, v = torch.split(x, hn, dim=-1)
        q, k, v = q.reshape(s, B, hn), k.reshape(s, B, hn), v.reshape(s, B, hn)
        buf = torch.empty(B, s, s)  # Megatron's global buffer: passed as baddbmm's input, beta 0
        scores = torch.baddbmm(buf, q.transpose(0, 1), k.transpose(0, 1).transpose(1, 2), beta=0.0,
                               alpha=1.0 / (hn ** 0.5 * layer))
        probs = torch.softmax(scores.view(b, nh, s, s) * layer, dim=-1)
        probs = torch.nn.functional.dropout(probs, 0.1, training=True)
        ctx = torch.bmm(probs.view(B, s, s), v.transpose(0, 1))
        ctx = ctx.view(b, nh, s, hn).permute(2, 0, 1, 3).contiguous()
    # forward: the batched GEMMs read the views as they are (no copy before either)
    assert fwd.names[0] == "baddbmm" and "bmm" in fwd.names
    before_bmm = fwd.names[:fwd.names.index("bmm")]
    assert "clone" not in before_bmm and "copy_" not in before_bmm and "contiguous" not in before_bmm
    assert fwd.names[-1] == "clone"  # the context's permute copy, the one copy
    with Calls() as bwd:
        ctx.sum().backward()
    names = bwd.names
    # the context copy's backward is a view: the first computing call is the AV bmm's
    assert [n for n in names if n in ("bmm", "mul", "cat", "clone", "copy_")][:2] == ["bmm", "bmm"]
    # baddbmm's backward: per operand a bmm then a multiply by alpha; then one cat of
    # the q / k / v gradients (the split's backward)
    tail = [n for n in names if n in ("bmm", "mul", "cat")][-5:]
    assert tail == ["bmm", "mul", "bmm", "mul", "cat"]
    assert mixed.grad is not None and mixed.grad.shape == mixed.shape


def test_family_kernels_match_those_calls():
    """The family's kernels for the same core, in the same order."""
    cfg = TransformerConfig("m", family="megatron_gpt", layers=1, hidden=32, heads=4, ffn=128, vocab=10,
                            max_positions=64)
    k = _Kernels(Builder(cfg, 2, 32, 2, PYTORCH_1_10))  # B = 8, s = 32: the fused softmax
    scores, ctx = k.scores(), k.context()
    assert [x.name for x in scores.fwd] == ["qk", "softmax"]
    assert [x.name for x in scores.bwd] == ["softmax_bwd", "qk.grad_a", "qk.grad_a.alpha", "qk.grad_b",
                                            "qk.grad_b.alpha"]
    assert [x.name for x in ctx.fwd] == ["av", "context_copy"] and [x.name for x in ctx.bwd] == ["av.grad_b",
                                                                                                  "av.grad_a"]
