"""bench/ds_host_old_python.py: its stand-in for commsim's TransformerConfig builds the same
model as the real class (so the seed-era timings are of the same module tree), and it
refuses to run on a Python that runs commsim itself."""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from commsim.models.transformer import TransformerConfig

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "ds_host_old_python.py"
sys.path.insert(0, str(ROOT / "bench"))

import ds_host_old_python  # noqa: E402  (importing defines; main() alone patches sys.modules)


@pytest.fixture(scope="module")
def old():
    return ds_host_old_python


def test_stand_in_takes_the_real_fields_in_order_with_their_defaults(old):
    params = list(inspect.signature(old.TransformerConfig).parameters.values())
    fields = dataclasses.fields(TransformerConfig)
    assert [p.name for p in params] == [f.name for f in fields]
    for p, f in zip(params, fields):
        want = inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default
        assert p.default == want, p.name


def test_stand_in_builds_the_same_model_as_the_real_config(old):
    torch = pytest.importorskip("torch")
    from runtime.ds_host_setup import model_config
    from runtime.torch_models import build_model

    real = model_config()
    stand_in = old.TransformerConfig(**{f.name: getattr(real, f.name) for f in dataclasses.fields(real)})
    for name in ("p_hidden", "p_attention", "act"):
        assert getattr(stand_in, name) == getattr(real, name)
    torch.manual_seed(0)
    a = build_model(real)
    torch.manual_seed(0)
    b = build_model(stand_in)
    assert [(n, p.shape) for n, p in a.named_parameters()] == [(n, p.shape) for n, p in b.named_parameters()]
    assert [type(m).__name__ for m in a.modules()] == [type(m).__name__ for m in b.modules()]
    assert [m.p for m in a.modules() if isinstance(m, torch.nn.Dropout)] == \
        [m.p for m in b.modules() if isinstance(m, torch.nn.Dropout)]


def test_other_families_are_refused(old):
    with pytest.raises(ValueError, match="only the harness's roberta"):
        old.TransformerConfig("x", "gpt2", 1, 16, 2, 64, 128)


def test_refuses_a_python_that_runs_commsim():
    out = subprocess.run([sys.executable, str(SCRIPT)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert out.stderr.strip() == "ds_host_old_python: this Python runs commsim: use python -m runtime.ds_host_costs"
