"""``runtime.ds_host_costs`` on a Python older than commsim's (3.10): the seed era's software.

    /root/.pyenv/versions/3.8.18/bin/python -m venv /tmp/py38
    /tmp/py38/bin/pip install torch==1.8.1 "numpy<1.24" psutil packaging tqdm hjson ninja py-cpuinfo
    PYTHONPATH=. /tmp/py38/bin/python bench/ds_host_old_python.py --deepspeed 0.5.10 \\
        --source /tmp/dsold/deepspeed-0.5.10 --world 8 -o costs.json

published-runs.md E2 ran DeepSpeed on PyTorch 1.8, whose wheels exist for Python 3.6-3.9
only; commsim needs 3.10. The host-cost harness uses commsim for one thing, the model's
shape (``TransformerConfig``, read by ``ds_host_setup.model_config`` and
``runtime.torch_models``), so this script gives that one class for the harness's
RoBERTa-shaped model, with the fields and defaults ``runtime.torch_models`` reads, and runs
the harness unchanged with every other argument passed through. torch 1.8's
``checkpoint`` is always reentrant and has no ``use_reentrant`` (1.11 added it): the
harness's reentrant call is passed on without it. The harness's timings, fits and JSON
are the same as on today's Python; traces/README.md ("host-costs/", ``era/``) compares
the two on one core.
"""

from __future__ import annotations

import runpy
import sys
import types

HARNESS = "runtime.ds_host_costs"
# Hugging Face RoBERTa's dropouts and activation (commsim.models.transformer.FAMILY_DEFAULTS)
ROBERTA_DEFAULTS = (0.1, 0.1, "gelu")


class TransformerConfig:
    """commsim.models.transformer.TransformerConfig's fields, for the roberta family only."""

    def __init__(self, name, family, layers, hidden, heads, ffn, vocab, max_positions=512, kv_heads=None,
                 type_vocab=1, tie_embeddings=True, hidden_dropout=None, attention_dropout=None, activation=None,
                 attention="eager", softmax_fusion=True):
        if family != "roberta" or attention != "eager" or not softmax_fusion:
            raise ValueError(f"{family} / {attention}: only the harness's roberta model with eager attention")
        self.name, self.family, self.layers, self.hidden, self.heads = name, family, layers, hidden, heads
        self.ffn, self.vocab, self.max_positions, self.kv_heads = ffn, vocab, max_positions, kv_heads
        self.type_vocab, self.tie_embeddings, self.attention = type_vocab, tie_embeddings, attention
        self.softmax_fusion = softmax_fusion
        self.hidden_dropout, self.attention_dropout, self.activation = hidden_dropout, attention_dropout, activation

    @property
    def p_hidden(self) -> float:
        return ROBERTA_DEFAULTS[0] if self.hidden_dropout is None else self.hidden_dropout

    @property
    def p_attention(self) -> float:
        return ROBERTA_DEFAULTS[1] if self.attention_dropout is None else self.attention_dropout

    @property
    def act(self) -> str:
        return ROBERTA_DEFAULTS[2] if self.activation is None else self.activation


def install_config() -> None:
    """``commsim.models.transformer`` as a module holding only TransformerConfig."""
    for name in ("commsim", "commsim.models", "commsim.models.transformer"):
        sys.modules[name] = types.ModuleType(name)
    sys.modules["commsim.models.transformer"].TransformerConfig = TransformerConfig


def reentrant_checkpoint_without_flag() -> None:
    """torch < 1.11: accept ``use_reentrant=True`` (its only mode) and drop it."""
    import torch.utils.checkpoint as ckpt

    if "use_reentrant" in (ckpt.checkpoint.__code__.co_varnames or ()):
        return
    plain = ckpt.checkpoint

    def checkpoint(function, *args, use_reentrant=True, **kwargs):
        if not use_reentrant:
            raise ValueError("torch before 1.11 has only the reentrant checkpoint")
        return plain(function, *args, **kwargs)

    ckpt.checkpoint = checkpoint


def main() -> None:
    if sys.version_info >= (3, 10):
        sys.exit("ds_host_old_python: this Python runs commsim: use python -m runtime.ds_host_costs")
    install_config()
    reentrant_checkpoint_without_flag()
    sys.argv[0] = HARNESS
    runpy.run_module(HARNESS, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
