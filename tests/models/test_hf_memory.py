"""One layer's backward memory, as commsim allocates it, against what PyTorch allocates.

The real Hugging Face layer (bf16, training mode) runs forward and backward on CPU
under ``torch.profiler`` with ``profile_memory``; its memory timeline
(``_memory_profile().timeline``: every tensor's creation and destruction, with the
profiler's category) gives the live bytes from the start of backward, parameters and
parameter gradients left out (the strategies allocate those), and so do the CPU
allocator's untyped scratch blocks (oneDNN's, not CUDA's). The catalogue's side is
``grad_memory.backward_live_bytes`` over the same layer's modules: what the ZeRO-3 and
FSDP2 generators allocate and free in backward (each module's input gradient and chain
temporaries, then its saved activations freed).

Checked: the peak above the start of backward and the bytes left at its end. Llama (no
dropout) is exact. RoBERTa and GPT-2 are bounded: commsim frees a saved tensor after the
backward of the module that made it, autograd after the module that saved it, one
module earlier where the two differ (the FFN-wide activation saved by the output
projection: 4 x tokens x hidden x 2 bytes at most), so commsim's peak is at least the
measured one and at most that much above it.
"""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from commsim.models import TransformerConfig, describe  # noqa: E402
from commsim.models.eager import PYTORCH_2  # noqa: E402
from commsim.models.grad_memory import backward_live_bytes, backward_memory  # noqa: E402
from tests.models.test_hf_kernels import B, S, hidden, llama_layer  # noqa: E402

SKIPPED = {"PARAMETER", "GRADIENT"}


def measured_backward(layer, x, **kwargs) -> tuple[int, int]:
    """(peak, end) of the live bytes during ``layer``'s backward, relative to its start,
    from the profiler's memory timeline; parameters, their gradients and untyped CPU
    scratch blocks left out, and so are the tensors made before the layer ran (its input,
    mask and rotary table, which autograd may keep and release: the catalogue counts
    them where they are made). The output gradient is made before the profile."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action

    layer = layer.to(torch.bfloat16).train()
    grad = torch.randn(x.shape, dtype=x.dtype)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        out = layer(x, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        start_ns = time.time_ns()  # the timeline's clock: ns since the epoch
        out.backward(grad)
    mp = prof._memory_profile()
    live, at_start, peak = 0, None, None
    for t, action, (key, version), size in mp.timeline:
        if at_start is None and t >= start_ns:
            at_start = peak = live
        if not hasattr(key, "id"):  # an allocation no tensor owns: the CPU allocator's scratch
            continue
        category = mp._categories.get(key, version)
        if category is not None and category.name in SKIPPED:
            continue
        if action in (Action.CREATE, Action.PREEXISTING):
            live += size
        elif action is Action.DESTROY:
            live -= size
        if at_start is not None:
            peak = max(peak, live)
    assert at_start is not None, "no memory event after backward started"
    return peak - at_start, live - at_start


def modelled_backward(cfg: TransformerConfig) -> tuple[int, int]:
    """The catalogue's (peak, end); at the end the layer's input gradient is the leaf
    input's ``.grad``, a GRADIENT in the profiler's categories (left out there too)."""
    md = describe(cfg, B, S, 2, torch=PYTORCH_2)
    layer = [m for m in md.modules if m.block == 0]
    peak, end = backward_live_bytes(layer)
    first = next(m for m in layer if backward_memory(m).grad_input_bytes)
    return peak, end - backward_memory(first).grad_input_bytes


@pytest.mark.parametrize("attention, kv_heads", [("eager", 4), ("eager", 2), ("sdpa", 4)])
def test_llama_layer_backward_memory(attention, kv_heads):
    layer, x, kwargs, cfg = llama_layer(attention, kv_heads)
    (peak, end), (want_peak, want_end) = measured_backward(layer, x, **kwargs), modelled_backward(cfg)
    assert peak == want_peak
    # eager attention's scale multiplies by a Python float: autograd keeps it as a
    # wrapped 0-dim double (8 bytes of host memory) that the catalogue has no kernel for
    assert end == want_end - (8 if attention == "eager" else 0)


@pytest.mark.parametrize("family", ["roberta", "gpt2"])
def test_roberta_and_gpt2_backward_memory(family):
    h, heads, ffn = 64, 4, 256
    if family == "roberta":
        from transformers.models.roberta.modeling_roberta import RobertaConfig, RobertaLayer

        hf = RobertaConfig(hidden_size=h, num_attention_heads=heads, intermediate_size=ffn, num_hidden_layers=1,
                           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        hf._attn_implementation = "eager"
        layer, mask = RobertaLayer(hf), torch.zeros(B, 1, 1, S, dtype=torch.bfloat16)
        cfg = TransformerConfig("t", "roberta", 1, h, heads, ffn, 100, max_positions=S + 2, hidden_dropout=0.0,
                                attention_dropout=0.0)
    else:
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block, GPT2Config

        hf = GPT2Config(n_embd=h, n_head=heads, n_layer=1, resid_pdrop=0.0, attn_pdrop=0.0, embd_pdrop=0.0)
        hf._attn_implementation = "eager"
        layer, mask = GPT2Block(hf, layer_idx=0), torch.zeros(B, 1, S, S, dtype=torch.bfloat16)
        cfg = TransformerConfig("t", "gpt2", 1, h, heads, ffn, 100, max_positions=S, hidden_dropout=0.0,
                                attention_dropout=0.0)
    torch.manual_seed(0)
    (peak, end), (want_peak, want_end) = measured_backward(layer, hidden(h), attention_mask=mask), modelled_backward(cfg)
    t = B * S
    # a saved tensor freed one module later than autograd frees it (the module docstring)
    assert peak <= want_peak <= peak + 4 * t * h * 2
    # at the end: the catalogue counts the layer's output where it is made (the next
    # layer keeps it), LayerNorm's mean and rstd in fp32 (CPU: bf16), and the eager
    # scores' scale and mask constants are small host tensors it has no kernels for
    # (8 bytes RoBERTa, 32 GPT-2)
    norms = 2 * 2 * t * (4 - 2)
    assert end == want_end + t * h * 2 + norms - {"roberta": 8, "gpt2": 32}[family]


def test_backward_memory_of_a_linear_chain():
    """The rule on a module by hand: a Linear's backward writes its input gradient
    (dgrad) and its weight and bias gradients (not in the chain)."""
    cfg = TransformerConfig("t", "roberta", 1, 64, 4, 256, 100, max_positions=S + 2)
    md = describe(cfg, B, S, 2, torch=PYTORCH_2)
    dense = next(m for m in md.modules if m.path.endswith("layer.0.output.dense"))
    assert backward_memory(dense).grad_input_bytes == B * S * 256 * 2
    assert backward_memory(dense).temp_bytes == 0
