"""Real PyTorch FSDP1 (``FullyShardedDataParallel``) on 2 gloo ranks, its memory recorded on
rank 0 by runtime/fsdp1_memory_trace.py: in the steady-state step (index 2, after two
steps, so that the rate limiter's queue carries over as commsim's generator assumes), the
ORDERED sequence of FSDP1's own allocations and frees and of the rate limiter's host blocks
must equal what ``generate_fsdp1`` emits for rank 0 with the same model (``tiny``),
micro-batch, sequence length and settings. The collectives are checked in
tests/runtime/test_fsdp1_fidelity.py; this is the memory ledger.

An event is (kind, buffer, bytes, stream, phase):

* kind ``alloc`` / ``free`` of one of the generator's buffers ``flat:<unit>`` (unsharded
  padded flat parameter), ``mp_shard:<unit>`` (the low-precision shard), ``fgrad:<unit>``
  (autograd's flat gradient), ``bwd.rs:<unit>.cast`` / ``.pad`` (reduce-dtype cast and
  padding before the reduce-scatter), ``sgrad:<unit>`` (the reduce-scatter's output),
  ``sgrad32:<unit>`` (its fp32 cast): how each is seen in the real run is in the recorder's
  docstring. Frees carry the size that was allocated;
* kind ``limiter``: a ``dequeue_if_needed`` that returned a free event, which FSDP1 then
  ``synchronize()``s on the host (RU:297-303); the generator's HostSync labelled
  "FSDP1 rate limiter". Its buffer names the ``flat:<unit>`` free the event was recorded
  after and that free's phase (generator: the first ``flat:`` free after the HostSync's
  dependency, the last op on the compute stream when the event was recorded);
* stream: for an alloc the stream current where FSDP's code allocates (observable on CPU:
  FSDP1's device handle is ``torch.cpu``, whose ``Stream`` objects are distinct and whose
  ``stream()`` context sets the current one), for a free the stream the buffer was
  allocated on (the caching-allocator pool it returns to, which is what commsim's ``Free``
  names), for a limiter wait the stream its event was recorded on;
* phase: fwd, bwd (autograd engine running: the recompute of checkpointing included;
  commsim's RECOMPUTE is bwd), opt (``AdamW.step`` and ``zero_grad``).

Left out on both sides: the generator's ``ugrad:`` (each parameter's gradient, which
autograd computes for the views into the unsharded flat parameter before concatenating
them into the flat gradient: autograd's, not FSDP's), ``act:`` / ``agrad:`` / ``atmp:``
(activations, their gradients, kernel temporaries: the model's compute) and
``optimizer.adamw:`` (torch.optim's temporaries); the recorder keeps only storages FSDP1's
code names. Also left out of the ordered comparison: limiter waits on free events carried
over from an earlier step (the real run ``synchronize()``s them too; the generator's queue
starts with that many "long complete" entries and emits no HostSync for them, since its
IR cannot depend on a previous step's ops): their number is checked on its own.
With 2 ranks no flat parameter of ``tiny`` needs padding, so ``.pad`` never occurs here
(run by hand on 3 ranks, defaults and bf16/fp32 mixed precision, it matched too: cast and
pad allocated, then freed in that order when ``_reduce_grad`` returns).

``zero_grad`` drops the sharded gradients in the optimizer's parameter order
(torch/optim/optimizer.py:1058-1062), which is ``model.parameters()``': the root's flat
parameter is registered on the root's wrapped module (_unshard_param_utils.py:89-101) and
nn.Module yields a module's own parameters before its submodules', so the root's first.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("torch.distributed.fsdp")

from commsim.api import describe_model  # noqa: E402
from commsim.ir import ops as O  # noqa: E402
from commsim.strategies import World, generate_fsdp1  # noqa: E402
from commsim.strategies.fsdp1_config import parse_fsdp1_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MICRO_BATCH, SEQ, STEPS, RECORD_STEP = 2, 16, 3, 2
# name -> (FSDP1 settings, checkpointing style or None)
CONFIGS = {
    # FULL_SHARD, limit_all_gathers, BACKWARD_PRE, fp32
    "defaults": ({}, None),
    # bf16 shards cast on pre_unshard and gathered; fp32 reduce: the flat gradient cast first
    "mixed-precision-backward-post": ({"mp_param_dtype": "bf16", "mp_reduce_dtype": "fp32",
                                       "backward_prefetch": "BACKWARD_POST"}, None),
    # bf16 reduce: the reduced shard cast back to fp32 (sgrad32)
    "mixed-precision-bf16-reduce": ({"mp_param_dtype": "bf16"}, None),
    # blocks kept unsharded from forward to their post-backward
    "shard-grad-op": ({"sharding_strategy": "SHARD_GRAD_OP"}, None),
    # Hugging Face's reentrant checkpointing outside the units: each block gathered for its recompute
    "defaults-reentrant": ({}, "reentrant"),
    # 2 micro-steps, each reduced: the second's shard added into the first's and freed
    "accumulate": ({"gradient_accumulation_steps": 2, "mp_param_dtype": "bf16"}, None),
    # 3 micro-steps, the first two inside no_sync(): the first's flat gradient kept as .grad,
    # the later ones added into it and freed, reduced once; with forward prefetch
    "accumulate-no-sync-forward-prefetch": ({"gradient_accumulation_steps": 3, "no_sync": True,
                                             "forward_prefetch": True}, None),
    # every parameter on every rank: a bf16 copy made at each pre-forward and pre-backward
    # and freed at each reshard; the bf16 gradient all-reduced, then cast to fp32 as .grad
    "no-shard-mixed-precision": ({"sharding_strategy": "NO_SHARD", "mp_param_dtype": "bf16"}, None),
    # and with an fp32 reduction: the gradient cast first, then all-reduced as .grad
    "no-shard-fp32-reduce": ({"sharding_strategy": "NO_SHARD", "mp_param_dtype": "bf16",
                              "mp_reduce_dtype": "fp32"}, None),
}
KEEP = ("flat:", "mp_shard:", "fgrad:", "bwd.rs:", "sgrad:", "sgrad32:", "bwd.ar:", "grad32:")
DROP = ("ugrad:", "act:", "agrad:", "atmp:", "ckpt:", "optimizer.adamw")
PHASE = {O.Phase.FORWARD: "fwd", O.Phase.BACKWARD: "bwd", O.Phase.RECOMPUTE: "bwd", O.Phase.OPTIMIZER: "opt"}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """One launch of 2 ranks running every configuration one after another."""
    d = tmp_path_factory.mktemp("fsdp1_memory")
    out = d / "events.json"
    configs = json.dumps([{"name": n, "fsdp": s, "checkpointing": c} for n, (s, c) in CONFIGS.items()])
    cmd = [sys.executable, "-m", "runtime.fsdp1_memory_trace", "--init", f"file://{d / 'rendezvous'}",
           "--configs", configs, "--out", str(out), "--steps", str(STEPS), "--record-step", str(RECORD_STEP),
           "--micro-batch", str(MICRO_BATCH), "--seq", str(SEQ)]
    env = dict(os.environ, WORLD_SIZE="2", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=dict(env, RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    try:
        logs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    return json.loads(out.read_text())


def generated(settings: dict, checkpointing: str | None, device: str = "cpu") -> tuple[list[tuple], int]:
    """Rank 0's FSDP-owned events in issue order, and how many of its limiter dequeues
    wait on nothing (steady state: as many as it enqueues, less its HostSyncs)."""
    cfg = parse_fsdp1_config(settings)
    md = describe_model("tiny", MICRO_BATCH, SEQ, 2 if cfg.param_dtype in ("bf16", "fp16") else 4)
    s = generate_fsdp1(md, World(1, 2), cfg, checkpointing=checkpointing is not None,
                       checkpoint_style=checkpointing or "reentrant", device=device)
    step = list(s.program_of(0).step)
    where = {op.id: i for i, op in enumerate(step)}
    sizes: dict[str, int] = {}
    events = []
    for op in step:
        if isinstance(op, (O.Alloc, O.Free)):
            base = re.sub(r"^mb\d+\.", "", op.buffer)  # a micro-step's prefix
            assert base.startswith(KEEP + DROP), f"{op.buffer}: a buffer this test does not know"
            if base.startswith(DROP):
                continue
            if isinstance(op, O.Alloc):
                sizes[op.buffer] = op.size_bytes
                events.append(("alloc", op.buffer, op.size_bytes, op.stream, PHASE[op.phase]))
            else:
                events.append(("free", op.buffer, sizes.get(op.buffer), op.stream, PHASE[op.phase]))
        elif isinstance(op, O.HostSync) and op.label.startswith("FSDP1 rate limiter"):
            (dep,) = op.deps
            j = where[dep]
            k = next(i for i in range(j + 1, len(step))
                     if isinstance(step[i], O.Free) and step[i].buffer.startswith("flat:"))
            # the event was recorded after that free: no later op on the event's stream before it
            assert not [x for x in step[j + 1:k] if getattr(x, "stream", None) == step[j].stream
                        and isinstance(x, (O.Compute, O.Collective, O.Copy))], op
            events.append(("limiter", f"{step[k].buffer} ({PHASE[step[k].phase]} free)", 0, step[j].stream,
                           PHASE[op.phase]))
    enqueued = sum(1 for e in events if e[0] == "free" and e[1].startswith("flat:")) if cfg.limit_all_gathers else 0
    return events, enqueued - sum(1 for e in events if e[0] == "limiter")


def real(run: dict) -> tuple[list[tuple], list[tuple]]:
    """The recorded events as the generator's, and the limiter waits on carried-over events."""
    events, carried = [], []
    for e in run["events"]:
        if e["kind"] == "limiter":
            ev = ("limiter", f"{e['buffer']} ({e['freed_in']} free)", 0, e["stream"], e["phase"])
            (carried if e["from_step"] < RECORD_STEP else events).append(ev)
        else:
            events.append((e["kind"], e["buffer"], e["bytes"], e["pool"], e["phase"]))
    return events, carried


def first_difference(got: list[tuple], want: list[tuple]) -> str:
    i = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), min(len(got), len(want)))
    fmt = lambda e: "-" if e is None else " ".join(map(str, e))  # noqa: E731
    at = lambda seq, i: seq[i] if i < len(seq) else None  # noqa: E731
    context = "\n".join(f"    #{j}: {fmt(got[j])}" for j in range(max(0, i - 3), i))
    return (f"first difference at event #{i} of {len(got)} recorded / {len(want)} generated "
            f"(kind, buffer, bytes, stream, phase)\n  before it, both:\n{context}\n"
            f"  generator: {fmt(at(want, i))}\n  real FSDP1: {fmt(at(got, i))}")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_forward_and_backward_memory_events_match_the_generator(recorded, name):
    settings, checkpointing = CONFIGS[name]
    got, carried = real(recorded[name])
    want, unsynced = generated(settings, checkpointing)
    got, want = [e for e in got if e[4] != "opt"], [e for e in want if e[4] != "opt"]
    assert len(got) > 10
    assert got == want, first_difference(got, want)
    # the limiter dequeues the generator leaves without a HostSync are those of events
    # carried over from an earlier step
    assert len(carried) == unsynced, (carried, unsynced)
    # the device changes the optimizer's kernels and host blocking, not FSDP's buffers
    cuda, unsynced_cuda = generated(settings, checkpointing, device="cuda")
    assert ([e for e in cuda if e[4] != "opt"], unsynced_cuda) == (want, unsynced)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_zero_grad_frees_match_the_generator(recorded, name):
    got = [e for e in real(recorded[name])[0] if e[4] == "opt"]
    want = [e for e in generated(*CONFIGS[name])[0] if e[4] == "opt"]
    assert len(got) == 3 and got == want, first_difference(got, want)


def test_the_recording_sees_what_it_should(recorded):
    """The recorder itself: sizes from FSDP's own flat parameters (49984 elements a block,
    77800 in the root), every buffer named, every flat parameter gathered and freed in
    the step, and zero_grad's real order (the root's gradient first)."""
    for name, run in recorded.items():
        assert {u: v["numel"] for u, v in run["units"].items()} == {
            "root": 77800, "roberta.encoder.layer.0": 49984, "roberta.encoder.layer.1": 49984}, name
        assert not [e for e in run["events"] if "?" in e["buffer"] or e["stream"].startswith("stream@")], name
        assert [e["buffer"].split(":")[1].removesuffix(".cast") for e in run["events"] if e["phase"] == "opt"] == [
            "root", "roberta.encoder.layer.0", "roberta.encoder.layer.1"], name
    kinds = [(e["kind"], e["buffer"].split(":")[0]) for e in recorded["defaults"]["events"]]
    assert kinds.count(("alloc", "flat")) == kinds.count(("free", "flat")) == 5
    assert kinds.count(("alloc", "fgrad")) == kinds.count(("free", "fgrad")) == 3
