"""The stage ``runtime.ds_host_costs`` times DeepSpeed's routines on: the model and its
ZeRO-3 configuration (the seed's ratios at width 16), torch.cuda's stream / event /
synchronize API as no-ops on a CPU-only torch, what the old releases import that torch 2
and numpy 2 lack, and a fake process group of the seed's world size."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types

WORLD = 64  # the seed's world; --world changes it (per-rank loops scale with it)
STEPS = 20  # after 2 warm-up steps (the trace is recorded in the first)

# The model and the config: the seed's ratios at width 16. roberta-10b: attention
# weights 26.2M elements, FFN weights 104.9M, 10.35G in all; DeepSpeed's defaults:
# prefetch bucket 5e7 (~2 attention weights), reuse distance and live budget 1e9
# (~0.1 of the model), persistence 1e5 (biases and LayerNorms persist, weights not).
HIDDEN, FFN, LAYERS, VOCAB = 16, 64, 6, 128
PREFETCH_BUCKET = 2 * HIDDEN * HIDDEN  # two attention weights
PERSISTENCE = HIDDEN * HIDDEN  # below a weight, above a bias
REUSE = LIVE = 2200  # about 0.1 of the model's 22k elements
BUCKET = 19 * HIDDEN * HIDDEN  # reduce bucket 5e8: about 19 attention weights
# gradients per bucket flush when the flush is timed alone (ds_host_costs.flush_sweep)
FLUSH_COUNTS = (1, 2, 4, 8, 12, 16, 24, 32, 40)


def model_config():
    from commsim.models.transformer import TransformerConfig

    return TransformerConfig("hostcost", family="roberta", layers=LAYERS, hidden=HIDDEN, heads=2, ffn=FFN,
                             vocab=VOCAB, max_positions=64)


# ---------------------------------------------------------------- no-op device calls


class NoopStream:
    def synchronize(self) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass


class NoopEvent:
    def __init__(self, *a, **k) -> None:
        pass

    def record(self, *a, **k) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class NoopHandle:
    def wait(self, *a, **k) -> None:
        pass

    def is_completed(self) -> bool:
        return True


def noop_handle(*a, **k) -> NoopHandle:
    return NoopHandle()


def stub_cuda(torch) -> None:
    """torch.cuda's stream / event / synchronize API as no-ops on a CPU-only torch."""
    cuda = torch.cuda
    cuda.synchronize = lambda *a, **k: None
    cuda.stream = lambda s=None: contextlib.nullcontext()
    cuda.current_stream = lambda *a, **k: NoopStream()
    cuda.default_stream = lambda *a, **k: NoopStream()
    cuda.Stream = NoopStream
    cuda.Event = NoopEvent
    cuda.current_device = lambda: torch.device("cpu")
    cuda.is_available = lambda: True
    cuda.nvtx.range_push = lambda *a, **k: None
    cuda.nvtx.range_pop = lambda *a, **k: None
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.Tensor.record_stream = lambda self, *a, **k: None


def shim_old_release(torch) -> None:
    """What 0.5.x / 0.6.0 import that torch 2 and numpy 2 no longer have."""
    if importlib.util.find_spec("torch._six") is None:  # torch 2 removed it; torch 1.x has its own
        six = types.ModuleType("torch._six")
        six.inf = float("inf")
        six.string_classes = (str, bytes)
        six.int_classes = int
        sys.modules["torch._six"] = six
    import numpy

    if not hasattr(numpy, "BUFSIZE"):
        numpy.BUFSIZE = 8192
    # 0.5.4's engine imports tensorboardX at module level (engine.py:20); the timed
    # routines never write a summary
    if importlib.util.find_spec("tensorboardX") is None:
        tbx = types.ModuleType("tensorboardX")
        tbx.SummaryWriter = object
        sys.modules["tensorboardX"] = tbx


def fake_world(world: int) -> None:
    """A process group of ``world`` ranks without a network: torch's fake backend, or,
    on a torch before it (1.x: the seed era's software, run for comparison from a venv of
    its own), a one-rank gloo group whose rank and size queries answer rank 0 of
    ``world`` (the collectives the routines call are no-ops either way, so only the
    queries reach the group)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError:
        store = dist.HashStore()
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        dist.get_world_size = lambda group=None: world
        dist.get_rank = lambda group=None: 0
        return
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
