"""The catalogue's kernels of one layer equal what the real Hugging Face layer launches.

Each family's layer (RobertaLayer, GPT2Block, LlamaDecoderLayer) is built by
``transformers`` from a small config, in bf16, eager attention, training mode (dropout
active), and run forward and backward on CPU under a ``TorchDispatchMode`` that sees
every ATen call after autograd and composite ops have been decomposed. The calls are
mapped to kernels and compared with the catalogue's kernels of layer 0 (forward in
module order, backward in the reverse), one by one: class, GEMM shape, bytes read and
written, elements written.

Mapping (ATen call -> kernel):
* ``mm``, ``addmm``, ``bmm`` -> a GEMM, shape from the operands;
* SDPA's fused attention (on CPU ``_scaled_dot_product_flash_attention_for_cpu``, on CUDA
  the FlashAttention kernel: one call each way with the same operands) -> ATTENTION;
* ``native_layer_norm`` and its backward -> NORM; ``_softmax`` / ``_log_softmax`` and their
  backward -> SOFTMAX; ``nll_loss_forward`` -> REDUCTION; ``sum`` / ``mean`` -> REDUCTION; ``embedding`` -> EMBEDDING; any other call
  that computes (copies, casts, ``clone``, ``cat``, pointwise math) -> ELEMENTWISE;
* views and metadata (``view``, ``_unsafe_view``, ``t``, ``transpose``, ``expand``,
  ``split``, ``slice``, ``squeeze``, ``unsqueeze``, ``detach``, ...) launch nothing and
  are dropped; ``empty_like`` allocates and launches nothing;
* dropout: on CPU ATen decomposes it (``empty_like``, ``bernoulli_``, ``div_``, ``mul``;
  backward a ``mul`` by the same noise); CUDA runs one ``native_dropout`` (output and a
  one-byte mask) and one ``native_dropout_backward``. The CPU calls on a noise tensor are
  folded into those two, with CUDA's bytes;
* LayerNorm's mean and rstd are counted in fp32, CUDA's accumulation type (CPU keeps
  them in bf16).
Bytes: each tensor argument read once, by its own extent (a broadcast operand by its
size before broadcasting), each output written once.

The catalogue follows PyTorch 2 here (``PYTORCH_2``: Linear with its bias in one addmm),
which is what torch 2.x runs; PyTorch 1.10's separate bias kernels differ only there.
"""

from __future__ import annotations

from math import prod

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

from commsim.models import TransformerConfig, describe  # noqa: E402
from commsim.models.eager import PYTORCH_2  # noqa: E402

B, S = 2, 8
IGNORED = {"view", "_unsafe_view", "t", "transpose", "expand", "permute", "unsqueeze", "squeeze", "slice",
           "select", "split", "split_with_sizes", "alias", "detach", "_reshape_alias", "as_strided", "empty_like",
           "lift_fresh"}
GEMMS = {"mm", "addmm", "bmm"}
KIND = {"native_layer_norm": "norm", "native_layer_norm_backward": "norm", "_softmax": "softmax",
        "_softmax_backward_data": "softmax", "sum": "reduction", "mean": "reduction", "embedding": "embedding",
        "_scaled_dot_product_flash_attention_for_cpu": "attention",
        "_scaled_dot_product_flash_attention_for_cpu_backward": "attention",
        "_log_softmax": "softmax", "_log_softmax_backward_data": "softmax", "nll_loss_forward": "reduction"}


def extent_bytes(t: "torch.Tensor") -> int:
    """A tensor's bytes by its own extent: broadcast (stride-0) dimensions count once."""
    return prod(n for n, st in zip(t.shape, t.stride()) if st != 0) * t.element_size()


class Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.kernels: list[tuple] = []
        self.noise: set[int] = set()  # storages of CPU dropout noise tensors
        self.keep: list["torch.Tensor"] = []
        self.backward = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._opname
        ins = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        if name in IGNORED:
            return out
        if name == "bernoulli_":
            self.noise.add(ins[0].untyped_storage().data_ptr())
            self.keep.append(ins[0])  # alive, so that no other tensor gets its memory
            return out
        noisy = [a for a in ins if a.untyped_storage().data_ptr() in self.noise]
        if name == "div_" and noisy:
            return out
        if name == "mul" and noisy:
            x = next(a for a in ins if a.untyped_storage().data_ptr() not in self.noise)
            n, a = x.numel(), x.element_size()
            # native_dropout: read x, write the output and a bool mask; its backward:
            # read the gradient and the mask, write the input gradient
            self.kernels.append(("dropout", None, n * a, n * a + n, n) if not self.backward else
                                ("dropout", None, n * a + n, n * a, n))
            return out
        read = sum(extent_bytes(a) for a in ins)
        written = sum(o.numel() * o.element_size() for o in outs)
        if name == "native_layer_norm":  # mean, rstd: fp32 on CUDA
            written = outs[0].numel() * outs[0].element_size() + sum(4 * o.numel() for o in outs[1:])
        if name == "native_layer_norm_backward":
            read = sum(extent_bytes(a) for a in ins if a.dim() != 3 or a.shape[-1] != 1) + \
                sum(4 * a.numel() for a in ins if a.dim() == 3 and a.shape[-1] == 1)
        gemm = None
        if name in GEMMS:
            a_, b_ = (ins[1], ins[2]) if name == "addmm" else (ins[0], ins[1])
            gemm = (a_.shape[-2], b_.shape[-1], a_.shape[-1], a_.shape[0] if name == "bmm" else 1)
        if KIND.get(name) == "attention":  # the score matmul's shape: (s, s_kv, head dim, batch x heads)
            q, k = (ins[0], ins[1]) if not self.backward else (ins[1], ins[2])
            gemm = (q.shape[2], k.shape[2], q.shape[3], q.shape[0] * q.shape[1])
        kind = "gemm" if name in GEMMS else KIND.get(name, "elementwise")
        self.kernels.append((kind, gemm, read, written, outs[0].numel()))
        return out


def catalogue(cfg: TransformerConfig) -> tuple[list[tuple], list[tuple]]:
    md = describe(cfg, B, S, 2, torch=PYTORCH_2)
    layer = [m for m in md.modules if m.block == 0]

    def row(k):
        g = None if k.gemm is None else (k.gemm.m, k.gemm.n, k.gemm.k, k.gemm.batch)
        return (k.kind.value, g, k.bytes_read, k.bytes_written, prod(k.shape))

    fwd = [row(k) for m in layer for k in m.fwd]
    bwd = [row(k) for m in reversed(layer) for k in m.bwd]
    return fwd, bwd


def profile(layer, x, **kwargs) -> tuple[list[tuple], list[tuple]]:
    layer = layer.to(torch.bfloat16).train()
    grad = torch.randn_like(x)
    rec = Recorder()
    with rec:
        out = layer(x, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        n = len(rec.kernels)
        rec.backward = True
        out.backward(grad)
    return rec.kernels[:n], rec.kernels[n:]


def hidden(h: int) -> "torch.Tensor":
    return torch.randn(B, S, h, dtype=torch.bfloat16, requires_grad=True)


def test_roberta_layer():
    from transformers.models.roberta.modeling_roberta import RobertaConfig, RobertaLayer

    h, heads, ffn = 64, 4, 256
    hf = RobertaConfig(hidden_size=h, num_attention_heads=heads, intermediate_size=ffn, num_hidden_layers=1)
    hf._attn_implementation = "eager"
    torch.manual_seed(0)
    mask = torch.zeros(B, 1, 1, S, dtype=torch.bfloat16)  # RobertaModel's extended additive mask
    got = profile(RobertaLayer(hf), hidden(h), attention_mask=mask)
    cfg = TransformerConfig("t", "roberta", 1, h, heads, ffn, 100, max_positions=S + 2)
    want = catalogue(cfg)
    assert got[0] == want[0]
    assert got[1] == want[1]


def test_gpt2_block():
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block, GPT2Config

    h, heads = 64, 4
    hf = GPT2Config(n_embd=h, n_head=heads, n_layer=1)
    hf._attn_implementation = "eager"
    torch.manual_seed(0)
    mask = torch.zeros(B, 1, S, S, dtype=torch.bfloat16)  # the causal mask, additive
    got = profile(GPT2Block(hf, layer_idx=0), hidden(h), attention_mask=mask)
    want = catalogue(TransformerConfig("t", "gpt2", 1, h, heads, 4 * h, 100, max_positions=S))
    assert got[0] == want[0]
    assert got[1] == want[1]


def llama_layer(attention: str, kv_heads: int, p: float = 0.0):
    """A LlamaDecoderLayer (bf16, training mode) with its input and call arguments (eager
    gets an additive mask, SDPA none: causal), and the catalogue's config of it."""
    from transformers.models.llama.modeling_llama import LlamaConfig, LlamaDecoderLayer, LlamaRotaryEmbedding

    h, heads, ffn = 64, 4, 176
    hf = LlamaConfig(hidden_size=h, num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=ffn,
                     num_hidden_layers=1, attention_dropout=p)
    hf._attn_implementation = attention
    torch.manual_seed(0)
    x = hidden(h)
    pos = torch.arange(S).unsqueeze(0)
    cos, sin = LlamaRotaryEmbedding(hf)(x, pos)
    mask = None if attention == "sdpa" else torch.zeros(B, 1, S, S, dtype=torch.bfloat16)
    kwargs = dict(attention_mask=mask, position_embeddings=(cos.to(torch.bfloat16), sin.to(torch.bfloat16)),
                  position_ids=pos)
    cfg = TransformerConfig("t", "llama", 1, h, heads, ffn, 100, kv_heads=kv_heads, attention=attention,
                            attention_dropout=p)
    return LlamaDecoderLayer(hf, layer_idx=0), x, kwargs, cfg


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("kv_heads", [2, 4])
def test_llama_decoder_layer(attention, kv_heads):
    """Eager: the score chain, repeat_kv when grouped. SDPA (no mask: causal): one fused
    attention call each way, on k and v's own heads, and no repeat, score chain or
    context copy."""
    layer, x, kwargs, cfg = llama_layer(attention, kv_heads)
    got = profile(layer, x, **kwargs)
    want = catalogue(cfg)
    if attention == "sdpa":
        h, heads = cfg.hidden, cfg.heads
        assert [k for k in got[0] if k[0] == "attention"] == [("attention", (S, S, h // heads, B * heads),
                                                                (B * S * h + 2 * B * S * kv_heads * h // heads) * 2,
                                                                B * S * h * 2 + B * heads * S * 4, B * S * h)]
    assert got[0] == want[0]
    assert got[1] == want[1]


def kept_bytes(call, existing) -> int:
    """Bytes of the distinct tensors autograd keeps for backward while ``call()`` runs,
    less those whose storage is one of ``existing`` (parameters, inputs)."""
    before = {t.untyped_storage().data_ptr() for t in existing if isinstance(t, torch.Tensor)}
    kept: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in before:
            kept[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        call()
    return sum(kept.values())


def saved_bytes(layer, x, **kwargs) -> int:
    """What autograd keeps for the layer's backward, less the parameters and what existed
    before the call (the input, the rotary table)."""
    return kept_bytes(lambda: layer(x, **kwargs), [*layer.parameters(), x, *tree_flatten(kwargs)[0]])


@pytest.mark.parametrize("attention, kv_heads, p", [("sdpa", 2, 0.0), ("sdpa", 4, 0.0), ("eager", 2, 0.0),
                                                    ("eager", 4, 0.0), ("eager", 4, 0.1)])
def test_llama_saved_activations(attention, kv_heads, p):
    """The catalogue's saved bytes of a Llama layer's modules (``ModuleSpec.saved_bytes``)
    sum to what autograd really keeps for that layer's backward."""
    layer, x, kwargs, cfg = llama_layer(attention, kv_heads, p)
    got = saved_bytes(layer.to(torch.bfloat16).train(), x, **kwargs)
    md = describe(cfg, B, S, 2, torch=PYTORCH_2)
    want = sum(m.activation_bytes for m in md.modules if m.block == 0)
    # dropout on CPU keeps its bf16 noise tensor where CUDA's native_dropout keeps a
    # one-byte mask (the catalogue's)
    cpu_noise = B * cfg.heads * S * S * (2 - 1) if p > 0 else 0
    assert got == want + cpu_noise
    # every module of the layer says what it keeps: none falls back to all its outputs
    assert all(m.saved_bytes is not None for m in md.modules if m.block == 0 and m.fwd)


@pytest.mark.parametrize("family, p", [("roberta", 0.1), ("roberta", 0.0), ("gpt2", 0.1), ("gpt2", 0.0)])
def test_roberta_and_gpt2_saved_activations(family, p):
    """RoBERTa's layer and GPT-2's block: the catalogue's saved bytes against autograd's,
    with dropout (p 0.1, Hugging Face's default) and without. Three CPU differences are
    taken off: LayerNorm keeps mean and rstd in bf16 (CUDA: fp32), dropout keeps its bf16
    noise (CUDA: a one-byte mask), and the layer's output, which the catalogue counts
    where it is made, is kept by the next layer, not run here."""
    h, heads, ffn = 64, 4, 256
    if family == "roberta":
        from transformers.models.roberta.modeling_roberta import RobertaConfig, RobertaLayer

        hf = RobertaConfig(hidden_size=h, num_attention_heads=heads, intermediate_size=ffn, num_hidden_layers=1,
                           hidden_dropout_prob=p, attention_probs_dropout_prob=p)
        hf._attn_implementation = "eager"
        layer, mask = RobertaLayer(hf), torch.zeros(B, 1, 1, S, dtype=torch.bfloat16)
        cfg = TransformerConfig("t", "roberta", 1, h, heads, ffn, 100, max_positions=S + 2, hidden_dropout=p,
                                attention_dropout=p)
    else:
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block, GPT2Config

        hf = GPT2Config(n_embd=h, n_head=heads, n_layer=1, resid_pdrop=p, attn_pdrop=p, embd_pdrop=p)
        hf._attn_implementation = "eager"
        layer, mask = GPT2Block(hf, layer_idx=0), torch.zeros(B, 1, S, S, dtype=torch.bfloat16)
        cfg = TransformerConfig("t", "gpt2", 1, h, heads, 4 * h, 100, max_positions=S, hidden_dropout=p,
                                attention_dropout=p)
    torch.manual_seed(0)
    x = hidden(h)
    got = saved_bytes(layer.to(torch.bfloat16).train(), x, attention_mask=mask)
    md = describe(cfg, B, S, 2, torch=PYTORCH_2)
    t = B * S
    want = sum(m.activation_bytes for m in md.modules if m.block == 0)
    dropped = 2 * t * h + B * heads * S * S if p > 0 else 0  # the two hidden dropouts' and the attention's elements
    assert got == want - 2 * (2 * t * 2) + dropped * (2 - 1) - t * h * 2
    assert all(m.saved_bytes is not None for m in md.modules if m.block == 0 and m.fwd)
