"""Model presets: the architectures of reference/scenarios.md, plus tiny test models.

Shapes are the published configurations: RoBERTa (Liu et al. 2019; HF
``roberta-base`` / ``roberta-large`` config.json), the RoBERTa-10B / -50B scale-ups
of the seed scenario, GPT-3 175B (Brown et al. 2020, table 2.1) and Llama 2
(Touvron et al. 2023; HF ``meta-llama/Llama-2-*-hf`` config.json).
"""

from __future__ import annotations

from commsim.ir.errors import CommsimInputError
from commsim.models.transformer import TransformerConfig

_R = dict(family="roberta", vocab=50265, max_positions=514, type_vocab=1)
_L = dict(family="llama", vocab=32000, max_positions=4096, tie_embeddings=False)

MODEL_PRESETS: dict[str, TransformerConfig] = {
    c.name: c
    for c in (
        TransformerConfig("roberta-base", layers=12, hidden=768, heads=12, ffn=3072, **_R),
        TransformerConfig("roberta-large", layers=24, hidden=1024, heads=16, ffn=4096, **_R),
        TransformerConfig("roberta-10b", layers=32, hidden=5120, heads=40, ffn=20480, **_R),
        TransformerConfig("roberta-50b", layers=64, hidden=8192, heads=64, ffn=32768, **_R),
        TransformerConfig("gpt3-175b", family="gpt2", layers=96, hidden=12288, heads=96, ffn=49152,
                          vocab=50257, max_positions=2048),
        TransformerConfig("llama2-7b", layers=32, hidden=4096, heads=32, ffn=11008, **_L),
        TransformerConfig("llama2-13b", layers=40, hidden=5120, heads=40, ffn=13824, **_L),
        TransformerConfig("llama2-70b", layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, **_L),
        # Small models for local runs on CPUs: kernels of milliseconds, as on a real cluster
        # the step is dominated by work rather than per-op overhead.
        TransformerConfig("small", family="roberta", layers=4, hidden=512, heads=8, ffn=2048, vocab=8000,
                          max_positions=258, type_vocab=1),
        TransformerConfig("medium", family="roberta", layers=6, hidden=768, heads=12, ffn=3072, vocab=8000,
                          max_positions=258, type_vocab=1),
        # The small model's size in the other two families (GPT-2: fused QKV Conv1D, GELU MLP,
        # tied LM head; Llama: RMSNorm, rotary, grouped-query attention, SwiGLU with the
        # 2/3 x 4h width rounded up to a multiple of 64, as Meta's configs round to 256)
        TransformerConfig("small-gpt2", family="gpt2", layers=4, hidden=512, heads=8, ffn=2048, vocab=8000,
                          max_positions=256),
        TransformerConfig("small-llama", family="llama", layers=4, hidden=512, heads=8, kv_heads=4, ffn=1408,
                          vocab=8000, max_positions=256, tie_embeddings=False),
        # Tiny models for tests and local runs (a few hundred thousand parameters).
        TransformerConfig("tiny", family="roberta", layers=2, hidden=64, heads=4, ffn=256, vocab=1000,
                          max_positions=130, type_vocab=1),
        TransformerConfig("tiny-gpt2", family="gpt2", layers=2, hidden=64, heads=4, ffn=256, vocab=1000,
                          max_positions=128),
        TransformerConfig("tiny-llama", family="llama", layers=2, hidden=64, heads=4, kv_heads=2, ffn=176,
                          vocab=1000, max_positions=128, tie_embeddings=False),
    )
}


def model_preset(name: str) -> TransformerConfig:
    try:
        return MODEL_PRESETS[name]
    except KeyError:
        raise CommsimInputError(
            f"--model {name!r}: not a preset and not a config.json file; presets: {', '.join(MODEL_PRESETS)}"
        ) from None
