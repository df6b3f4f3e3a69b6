"""Models from real code: the walked torch module equals the catalogue's description."""

import subprocess
import sys

import pytest

from commsim.ir.errors import CommsimInputError
from commsim.models import MODEL_PRESETS, describe
from commsim.models.torch_walk import describe_module


def test_walked_tiny_roberta_is_the_catalogue_tree():
    walked = describe_module("runtime.torch_models:tiny", 2, 16)
    cat = describe(MODEL_PRESETS["tiny"], 2, 16)
    assert [(m.path, m.encloses, m.params) for m in walked.modules] == [
        (m.path, m.encloses, m.params) for m in cat.modules]
    assert walked.registered_params() == cat.registered_params()
    # the same Linear matmuls, module by module: (path, m, n, k, batch)
    def gemms(d):
        return [(m.path, k.gemm.m, k.gemm.n, k.gemm.k, k.gemm.batch) for m in d.modules for k in m.fwd
                if k.kind.value == "gemm" and m.kind.value == "linear"]

    assert gemms(walked) == gemms(cat)
    # the attention scores and context: two batched matmuls per layer, charged to the
    # dropout module that runs between them
    scores = [(m.path, k.gemm.batch) for m in walked.modules for k in m.fwd
              if k.kind.value == "gemm" and m.path.endswith("attention.self.dropout")]
    assert scores == [(f"roberta.encoder.layer.{i}.attention.self.dropout", 8) for i in (0, 0, 1, 1)]


def test_bad_factories():
    with pytest.raises(CommsimInputError, match="expected module:function"):
        describe_module("runtime.torch_models", 1, 8)
    with pytest.raises(CommsimInputError, match="has no function nope"):
        describe_module("runtime.torch_models:nope", 1, 8)


def test_schedule_from_module_function(tmp_path):
    out = subprocess.run([sys.executable, "-m", "commsim.cli", "schedule", "--model", "runtime.torch_models:tiny",
                          "--nodes", "1", "--gpus-per-node", "2", "--micro-batch", "2", "--seq", "16",
                          "-o", str(tmp_path / "s.json")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert subprocess.run([sys.executable, "-m", "commsim.cli", "validate", str(tmp_path / "s.json")]).returncode == 0


def test_the_local_roberta_drops_out_as_the_catalogue_says():
    """The module real DeepSpeed and FSDP2 train locally launches the dropout kernels the
    generated step lists: Hugging Face's probabilities (0.1), or the config's own."""
    import dataclasses

    from torch import nn

    from runtime.torch_models import build_model

    cfg = MODEL_PRESETS["tiny"]
    drops = [m.p for m in build_model(cfg).modules() if isinstance(m, nn.Dropout)]
    assert drops and set(drops) == {cfg.p_hidden, cfg.p_attention} == {0.1}
    off = dataclasses.replace(cfg, hidden_dropout=0.0, attention_dropout=0.2)
    by_name = {n: m.p for n, m in build_model(off).named_modules() if isinstance(m, nn.Dropout)}
    assert by_name["roberta.encoder.layer.0.attention.self.dropout"] == 0.2
    assert by_name["roberta.embeddings.dropout"] == by_name["roberta.encoder.layer.0.output.dropout"] == 0.0
