"""Outside the layers: the catalogue's embeddings, final norm, head and loss against the
real Hugging Face models on CPU (bf16, training mode, one layer).

* Saved activations of the whole model: what autograd keeps for backward during one
  forward with labels (``saved_tensors_hooks``; parameters, the inputs and the model's
  buffers left out), against the sum of every module's ``activation_bytes``. With the
  layers already checked (test_hf_kernels.py), this checks the modules around them.
  CPU differences taken off, as there: LayerNorm keeps mean and rstd in bf16 (CUDA:
  fp32), dropout keeps its bf16 noise (CUDA: a one-byte mask).
* The causal-LM loss's kernels (transformers' ``ForCausalLMLoss``, which GPT-2 and Llama
  call): the ATen calls of the loss on a logits tensor, forward and backward, against
  the catalogue's head kernels other than the head's GEMMs.
"""

from __future__ import annotations

from math import prod

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from torch.utils._pytree import tree_flatten  # noqa: E402

from commsim.ir.ops import ComputeKind  # noqa: E402
from commsim.models import TransformerConfig, describe  # noqa: E402
from commsim.models.eager import PYTORCH_2  # noqa: E402
from tests.models.test_hf_kernels import B, S, Recorder, kept_bytes  # noqa: E402

H, HEADS, V = 64, 4, 128


def model_saved_bytes(model, **inputs) -> int:
    """What autograd keeps during ``model``'s forward with its loss, less parameters,
    inputs and buffers (what existed before the call)."""
    def call():
        assert model(**inputs).loss is not None

    return kept_bytes(call, [*model.parameters(), *model.buffers(), *tree_flatten(inputs)[0]])


def catalogue_saved(cfg: TransformerConfig) -> int:
    md = describe(cfg, B, S, 2, torch=PYTORCH_2)
    assert all(m.saved_bytes is not None for m in md.modules if m.fwd), "a module falls back to all its outputs"
    return sum(m.activation_bytes for m in md.modules)


def ids() -> "torch.Tensor":
    torch.manual_seed(0)
    return torch.randint(2, V, (B, S))


@pytest.mark.parametrize("p", [0.0, 0.1])
def test_roberta_for_masked_lm_saved(p):
    from transformers import RobertaConfig, RobertaForMaskedLM

    hf = RobertaConfig(hidden_size=H, num_attention_heads=HEADS, intermediate_size=4 * H, num_hidden_layers=1,
                       vocab_size=V, max_position_embeddings=S + 2, type_vocab_size=1, hidden_dropout_prob=p,
                       attention_probs_dropout_prob=p)
    hf._attn_implementation = "eager"
    model = RobertaForMaskedLM(hf).to(torch.bfloat16).train()
    x = ids()
    got = model_saved_bytes(model, input_ids=x, labels=x.clone())
    cfg = TransformerConfig("t", "roberta", 1, H, HEADS, 4 * H, V, max_positions=S + 2, hidden_dropout=p,
                            attention_dropout=p)
    t = B * S
    norms = 4 * 2 * t * (2 - 4)  # the embeddings', the layer's two and the head's LayerNorm
    noise = (3 * t * H + B * HEADS * S * S) * (2 - 1) if p > 0 else 0  # embeddings', layer's three dropouts
    assert got == catalogue_saved(cfg) + norms + noise


@pytest.mark.parametrize("p", [0.0, 0.1])
def test_gpt2_lm_head_model_saved(p):
    from transformers import GPT2Config, GPT2LMHeadModel

    hf = GPT2Config(n_embd=H, n_head=HEADS, n_layer=1, vocab_size=V, n_positions=S, resid_pdrop=p, attn_pdrop=p,
                    embd_pdrop=p)
    hf._attn_implementation = "eager"
    model = GPT2LMHeadModel(hf).to(torch.bfloat16).train()
    x = ids()
    got = model_saved_bytes(model, input_ids=x, labels=x.clone())
    cfg = TransformerConfig("t", "gpt2", 1, H, HEADS, 4 * H, V, max_positions=S, hidden_dropout=p,
                            attention_dropout=p)
    t = B * S
    norms = 3 * 2 * t * (2 - 4)  # ln_1, ln_2, ln_f
    noise = (3 * t * H + B * HEADS * S * S) * (2 - 1) if p > 0 else 0  # drop, the block's three dropouts
    assert got == catalogue_saved(cfg) + norms + noise


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_llama_for_causal_lm_saved(attention):
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaConfig(hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=2, intermediate_size=176,
                     num_hidden_layers=1, vocab_size=V, max_position_embeddings=S, tie_word_embeddings=False)
    hf._attn_implementation = attention
    model = LlamaForCausalLM(hf).to(torch.bfloat16).train()
    x = ids()
    got = model_saved_bytes(model, input_ids=x, labels=x.clone())
    cfg = TransformerConfig("t", "llama", 1, H, HEADS, 176, V, max_positions=S, kv_heads=2, attention=attention,
                            tie_embeddings=False)
    assert got == catalogue_saved(cfg)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_causal_lm_loss_kernels(family):
    """ForCausalLMLoss's ATen calls on bf16 logits, forward and backward, equal the
    catalogue's head kernels around its GEMMs."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    torch.manual_seed(0)
    logits = torch.randn(B, S, V, dtype=torch.bfloat16, requires_grad=True)
    labels = ids()
    rec = Recorder()
    with rec:
        loss = ForCausalLMLoss(logits, labels, V)
        n = len(rec.kernels)
        rec.backward = True
        loss.backward()
    got_fwd, got_bwd = rec.kernels[:n], rec.kernels[n:]
    cfg = TransformerConfig("t", family, 1, H, HEADS, 4 * H, V, max_positions=S)
    head = describe(cfg, B, S, 2, torch=PYTORCH_2).modules[-1]
    assert head.path == "lm_head"
    want_fwd = [k for k in head.fwd if k.kind is not ComputeKind.GEMM]
    want_bwd = [k for k in head.bwd if k.name not in ("dgrad", "wgrad")]

    def row(k):
        return (k.kind.value, None, k.bytes_read, k.bytes_written, prod(k.shape))

    # The recorder counts every tensor argument's extent as read; three calls read less
    # of theirs, as the catalogue counts them: nll_loss reads one fp32 log-probability
    # per row (a gather), not the whole (rows, vocab) input; the seed gradient
    # (ones_like) and nll_loss_backward take only the shape of the loss / the
    # log-probabilities.
    rows, f = B * S, 4
    unread = {("fwd", 4): rows * V * f - rows * f, ("bwd", 0): f, ("bwd", 1): rows * V * f}

    def read_as_catalogue(rows_got, pass_name):
        return [(kind, g, read - unread.get((pass_name, i), 0), written, n)
                for i, (kind, g, read, written, n) in enumerate(rows_got)]

    assert read_as_catalogue(got_fwd, "fwd") == [row(k) for k in want_fwd]
    assert read_as_catalogue(got_bwd, "bwd") == [row(k) for k in want_bwd]
