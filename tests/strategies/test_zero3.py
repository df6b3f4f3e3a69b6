"""ZeRO-3 lowering: valid schedules, DeepSpeed's byte counts and rules, knobs."""

from dataclasses import fields
from math import ceil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from commsim.ir import ops as O
from commsim.ir.validate import validate
from commsim.models import MODEL_PRESETS, TransformerConfig, describe
from commsim.strategies import World, generate
from commsim.strategies.dsconfig import parse_ds_config
from commsim.strategies.knobs import KNOB_PRESETS, Knobs, knobs_from
from commsim.strategies.zero3 import module_trace


def ds(**zero):
    return parse_ds_config({"bf16": {"enabled": True}, "zero_optimization": {"stage": 3, **zero}})


def colls(schedule, kind):
    return [op for op in schedule.programs[0].step if isinstance(op, O.Collective) and op.kind is kind]


@st.composite
def small_models(draw):
    family = draw(st.sampled_from(["roberta", "gpt2", "llama"]))
    heads = draw(st.sampled_from([1, 2, 4]))
    hidden = heads * draw(st.sampled_from([4, 8, 16]))
    cfg = TransformerConfig("rand", family, layers=draw(st.integers(1, 3)), hidden=hidden, heads=heads,
                            ffn=draw(st.sampled_from([16, 48, 64])), vocab=draw(st.integers(10, 300)),
                            max_positions=64, kv_heads=heads if family != "llama" else draw(st.sampled_from([1, heads])),
                            tie_embeddings=family != "llama")
    return describe(cfg, draw(st.integers(1, 3)), draw(st.sampled_from([4, 16])))


ZERO_KEYS = st.fixed_dictionaries({}, optional={
    "reduce_bucket_size": st.integers(1, 20000),
    "stage3_prefetch_bucket_size": st.integers(0, 20000),
    "stage3_max_live_parameters": st.integers(0, 20000),
    "stage3_max_reuse_distance": st.integers(0, 20000),
    "stage3_param_persistence_threshold": st.integers(0, 2000),
    "contiguous_gradients": st.booleans(),
    "overlap_comm": st.booleans(),
    "sub_group_size": st.integers(1, 50000),
})


@settings(max_examples=40, deadline=None)
@given(small_models(), st.integers(1, 4), ZERO_KEYS, st.sampled_from(["baseline", "optimized"]), st.booleans(),
       st.integers(1, 2), st.sampled_from(["bf16", "fp16"]))
def test_every_generated_schedule_is_valid_and_reduces_each_gradient_once(md, world, zero, preset, ckpt, gas, prec):
    cfg = parse_ds_config({prec: {"enabled": True}, "zero_optimization": {"stage": 3, **zero}})
    s = generate(md, World(1, world), cfg, KNOB_PRESETS[preset], checkpointing=ckpt, grad_accum=gas)
    assert validate(s) == []
    rs = sum(op.size_bytes for op in colls(s, O.CollectiveKind.REDUCE_SCATTER))
    assert rs == gas * sum(world * ceil(p.numel / world) * 2 for p in md.unique_params())
    _assert_compute_waits_for_gathers(s)


def _assert_compute_waits_for_gathers(schedule):
    """No compute reads a gathered parameter before the op that wrote it is an ancestor.

    Ancestors follow explicit deps, stream order, and host syncs (an op issued after a
    host sync on X starts after X). Each op's ancestors are a bit set over the step's op
    indices (an int), so a step of thousands of kernels checks in linear-ish time.
    """
    step = schedule.programs[0].step
    index = {op.id: i for i, op in enumerate(step)}
    anc: dict[int, int] = {}  # device op id -> its ancestors' bits
    last_on: dict[str, int] = {}
    host_done = 0  # ops known finished when the host passes this point, closed under ancestry
    writer: dict[str, int] = {}

    def closed(ids) -> int:
        bits = 0
        for j in ids:
            if j in anc:
                bits |= anc[j] | (1 << index[j])
        return bits

    for op in step:
        if isinstance(op, O.HostSync):
            if op.scope is O.SyncScope.DEVICE:
                host_done |= closed(last_on.values())
            elif op.scope is O.SyncScope.STREAM and op.stream in last_on:
                host_done |= closed([last_on[op.stream]])
            else:
                host_done |= closed(op.deps)
            continue
        if not O.is_device_op(op):
            continue
        preds = list(op.deps) + ([last_on[op.stream]] if op.stream in last_on else [])
        a = host_done | closed(preds)
        anc[op.id] = a
        last_on[op.stream] = op.id
        if isinstance(op, O.Compute):
            for b in op.buffers:
                if b.startswith("param:") and b in writer:
                    w = writer[b]
                    assert a >> index[w] & 1, f"{op.label} may read {b} before {step[index[w]].label} ends"
        if isinstance(op, (O.Collective, O.Copy)) and op.stream != "compute" or isinstance(op, O.Collective):
            for b in op.buffers:
                writer[b] = op.id


@settings(max_examples=40, deadline=None)
@given(small_models(), st.integers(1, 4), st.sampled_from([0, 1, 2]), st.integers(1, 3000), st.booleans(),
       st.integers(1, 2), st.booleans())
def test_stages_0_to_2_are_valid_and_reduce_every_gradient(md, world, stage, bucket, overlap, gas, ckpt):
    cfg = parse_ds_config({"bf16": {"enabled": True}, "zero_optimization": {
        "stage": stage, "reduce_bucket_size": bucket, "overlap_comm": overlap}})
    s = generate(md, World(1, world), cfg, KNOB_PRESETS["optimized"], checkpointing=ckpt, grad_accum=gas)
    assert validate(s) == []
    total = sum(p.numel for p in md.unique_params())
    ar = [op for op in colls(s, O.CollectiveKind.ALL_REDUCE) if op.dtype is O.DType.BF16]
    # every gradient all-reduced once per micro-step (stage 2) or per step (0, 1)
    assert sum(op.size_bytes for op in ar) == total * 2 * (gas if stage == 2 else 1)
    ag = colls(s, O.CollectiveKind.ALL_GATHER)
    if stage == 0:
        assert ag == []
    else:  # stages 1/2 move 2x the parameter bytes per step: gradients in, parameters out
        # (the flat buffer padded to 2 x the world size: nccl_start_alignment_factor)
        assert [op.size_bytes for op in ag] == [-(-total // (2 * world)) * 2 * world * 2]


@pytest.mark.parametrize("overlap", [False, True])
def test_zero2_gradient_buffers_are_fresh_every_step(overlap):
    """DeepSpeed's stage 2 makes its bucket buffer(s) with torch.empty per backward
    (two when overlap_comm), grads_in_partition at the first reduction, fp64 copies of
    the partition's gradient pieces for the norm, and the flat fp32 gradient in step():
    all allocated and freed inside the step. Each bucket buffer's touch_bytes is the
    largest bucket placed in it, buckets alternating between the two buffers."""
    md = describe(MODEL_PRESETS["tiny"], 2, 16)
    cfg = parse_ds_config({"zero_optimization": {"stage": 2, "reduce_bucket_size": 20000, "overlap_comm": overlap}})
    prog = generate(md, World(1, 2), cfg, Knobs()).programs[0]
    assert validate(generate(md, World(1, 2), cfg, Knobs())) == []
    assert [op.buffer for op in prog.setup] == ["params16", "fp32", "exp_avg", "exp_avg_sq"]
    allocs = {op.buffer: op for op in prog.step if isinstance(op, O.Alloc)}
    frees = [op.buffer for op in prog.step if isinstance(op, O.Free)]
    n_buf = 2 if overlap else 1
    ar = [op.size_bytes for op in prog.step if isinstance(op, O.Collective) and op.label.startswith("bwd.ar")]
    assert len(ar) > 2 and max(ar) > 20000 * 4  # the tiny model's embedding is larger than a bucket
    for j in range(n_buf):
        a = allocs[f"ipg_bucket{j}"]
        # (a gradient larger than the bucket bypasses the buffer: it is reduced alone)
        assert a.size_bytes == 20000 * 4 and f"ipg_bucket{j}" in frees
        assert a.touch_bytes == max(size for size in ar[j::n_buf] if size <= 20000 * 4)
    assert "ipg_bucket1" not in allocs or overlap
    total = sum(p.numel for p in md.registered_params())
    part = ceil(total / 2)
    assert allocs["grad_partition"].size_bytes == part * 4 and allocs["grad32"].size_bytes == part * 4
    norms = [op.size_bytes for op in prog.step if isinstance(op, O.Alloc) and ".fp64[" in op.buffer]
    assert sum(norms) == part * 8 and all(b in frees for b in ("grad_partition", "grad32"))
    # everything but the model state is gone by the end of the step
    assert set(allocs) - set(frees) == set()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_zero3_fp32_gradient_and_fp64_norms_are_made_every_step(precision):
    """Stage 3 keeps the reduced gradients in a persistent partition of the parameters'
    dtype; each step it converts every parameter's shard to fp64 for the norm and
    flattens the partition into a fresh fp32 gradient (through a 16-bit flat tensor
    when the gradients are 16-bit), released after the sub-group's step."""
    md = describe(MODEL_PRESETS["tiny"], 2, 16)
    cfg = parse_ds_config({"bf16": {"enabled": precision == "bf16"}, "zero_optimization": {"stage": 3}})
    prog = generate(md, World(1, 2), cfg, Knobs()).programs[0]
    dt = 4 if precision == "fp32" else 2
    part = sum(ceil(q.numel / 2) for q in md.registered_params())
    setup = {a.buffer: a.size_bytes for a in prog.setup}
    assert setup["grad16[0]"] == part * dt and "grad32[0]" not in setup
    allocs = {op.buffer: op.size_bytes for op in prog.step if isinstance(op, O.Alloc)}
    frees = {op.buffer for op in prog.step if isinstance(op, O.Free)}
    assert allocs["grad32[0]"] == part * 4 and "grad32[0]" in frees
    assert ("gradflat16[0]" in allocs) == (dt == 2)
    norms = [size for buf, size in allocs.items() if buf.startswith("optimizer.norm.fp64[")]
    assert sorted(norms) == sorted(ceil(q.numel / 2) * 8 for q in md.registered_params())


def test_optimized_and_baseline_differ_exactly_in_the_knobs():
    # every knob is one of the seed's changes: 0.5.10 and 0.6.0 differ in each; 0.19.8
    # kept all of 0.6.0's sides
    opt, base = KNOB_PRESETS["optimized"], KNOB_PRESETS["baseline"]
    differing = [f.name for f in fields(Knobs) if getattr(opt, f.name) != getattr(base, f.name)]
    assert differing == [f.name for f in fields(Knobs)]  # every knob, nothing else
    assert KNOB_PRESETS["current"] == opt


def _tiny(**zero):
    return generate(describe(MODEL_PRESETS["tiny"], 2, 16), World(1, 2), ds(**zero), Knobs())


def test_minimal_live_parameters_gather_every_use():
    # Persistence 0, no prefetch, no reuse: every module's parameters are gathered at
    # every use (forward, recompute, backward): count them independently.
    md = describe(MODEL_PRESETS["tiny"], 2, 16)
    s = generate(md, World(1, 2), ds(stage3_param_persistence_threshold=0, stage3_max_live_parameters=0,
                                     stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=0), Knobs())
    expected, held = [], set()  # parameters an open container (lm_head) still holds
    for e in module_trace(md, True):
        if e.fetch:
            need = [p for p in e.module.params if p.name not in held]
            if need:
                expected.append(sum(2 * ceil(p.numel / 2) * 2 for p in need))
            if e.module.encloses:
                held |= {p.name for p in e.module.params}
        elif e.release and e.module.encloses:
            held -= {p.name for p in e.module.params}
    got = [op.size_bytes for op in colls(s, O.CollectiveKind.ALL_GATHER)]
    assert got == expected


def test_default_reuse_distance_gathers_each_parameter_once():
    # DeepSpeed's defaults on a tiny model: nothing is released before its last use in
    # the step (reuse distance 1e9 elements), so each non-persistent parameter is
    # gathered once; persistent ones (<= 1e5 elements: all of tiny's) not at all,
    # except the synchronous re-gather after the optimizer step.
    md = describe(MODEL_PRESETS["tiny"], 2, 16)
    s = generate(md, World(1, 2), ds(), Knobs())
    ags = colls(s, O.CollectiveKind.ALL_GATHER)
    # the synchronous re-gather after the step: one all-gather per persistent parameter,
    # in named_parameters() order (stage3._post_step)
    assert {op.label.split(".")[0] for op in ags} == {"optimizer"}
    assert [op.size_bytes for op in ags] == [2 * ceil(p.numel / 2) * 2 for p in md.registered_params()]
    s = generate(md, World(1, 2), ds(stage3_param_persistence_threshold=0), Knobs())
    total = sum(op.size_bytes for op in colls(s, O.CollectiveKind.ALL_GATHER))
    assert total == sum(2 * ceil(p.numel / 2) * 2 for p in md.unique_params())


def test_reduce_bucket_size_sets_reduce_scatter_count():
    n_params = len(describe(MODEL_PRESETS["tiny"], 2, 16).unique_params())
    assert len(colls(_tiny(reduce_bucket_size=1), O.CollectiveKind.REDUCE_SCATTER)) == n_params
    assert len(colls(_tiny(reduce_bucket_size=10**9), O.CollectiveKind.REDUCE_SCATTER)) == 1


def test_prefetch_bucket_zero_means_no_prefetch():
    s = _tiny(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=0)
    assert not [op for op in colls(s, O.CollectiveKind.ALL_GATHER) if "prefetch" in op.label]
    s = _tiny(stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0)
    assert [op for op in colls(s, O.CollectiveKind.ALL_GATHER) if "prefetch" in op.label]


def _count(s, pred):
    return sum(1 for op in s.programs[0].step if pred(op))


def _labels(s, kind, text):
    return [op for op in s.programs[0].step if isinstance(op, kind) and text in op.label]


def _syncs(s, text, scope=None):
    return [op for op in _labels(s, O.HostSync, text) if scope is None or op.scope is scope]


def _fetches_gathering(s):
    """Hook calls (fetch host ops) followed by a demand all-gather before the next hook."""
    n, open_ = 0, False
    for op in s.programs[0].step:
        if isinstance(op, O.HostWork) and op.kind is O.HostKind.MODULE_HOOK and op.label.startswith("hook "):
            open_ = True
        elif open_ and isinstance(op, O.Collective) and ".fetch:" in op.label:
            n, open_ = n + 1, False
    return n


_AG, _RS = O.CollectiveKind.ALL_GATHER, O.CollectiveKind.REDUCE_SCATTER


def _params_gathered_async(s):
    """Parameters the fetch and prefetch all-gathers carry (a label ends +k for k more)."""
    n = 0
    for op in colls(s, _AG):
        if ".fetch:" in op.label or ".prefetch:" in op.label:
            tail = op.label.rsplit(":", 1)[1]
            n += 1 + (int(tail.rsplit("+", 1)[1]) if "+" in tail else 0)
    return n
_N_PARAMS = len(describe(MODEL_PRESETS["tiny"], 2, 16).unique_params())


@pytest.mark.parametrize("knob, value, check", [
    ("coalesced_collectives", False,
     lambda s, base: len(colls(s, _AG)) > len(colls(base, _AG)) and len(colls(s, _RS)) == _N_PARAMS),
    # 0.5.10: a device-wide synchronize before each prefetched all-gather and after each
    # fetch's demand gathers, then a stream + device synchronize at that fetch
    ("fine_grained_sync", False,
     lambda s, base: len(_syncs(s, "before the prefetch all-gather", O.SyncScope.DEVICE))
     == len([op for op in colls(s, _AG) if ".prefetch:" in op.label]) > 0
     and len(_syncs(s, "demand all-gather", O.SyncScope.DEVICE)) == _fetches_gathering(s) > 0
     and len(_syncs(s, "fetch: torch.cuda.synchronize", O.SyncScope.DEVICE))
     == len(_syncs(s, "fetch: all-gather stream synchronize", O.SyncScope.STREAM)) > 0
     and not _syncs(s, "fetch back-pressure")),
    ("flat_reduce_scatter", False,
     lambda s, base: _count(s, lambda o: isinstance(o, O.Alloc) and o.buffer.startswith("rstmp"))
     == len(colls(s, _RS)) and not _count(s, lambda o: isinstance(o, O.Alloc) and o.buffer.startswith("agtmp"))),
    ("fused_grad_norm", False,
     lambda s, base: _count(s, lambda o: isinstance(o, O.Copy) and "norm_item:" in o.label) == _N_PARAMS),
    ("fused_overflow_check", False,
     lambda s, base: len(_labels(s, O.Copy, "overflow_item:")) == _N_PARAMS
     and not _labels(s, O.Compute, ".isinf:") and len(_labels(base, O.Compute, ".isinf:")) == _N_PARAMS),
    ("debug_string_ops", True,
     lambda s, base: _count(s, lambda o: isinstance(o, O.Copy) and ".debug_item:" in o.label)
     == sum(len({p.name for p in e.module.params})
            for e in module_trace(describe(MODEL_PRESETS["tiny"], 2, 16), True) if e.fetch)),
    # 0.5.10's trace is one position off: nothing prefetched, every use gathered on demand
    ("precomputed_fetch", False,
     lambda s, base: not [op for op in colls(s, _AG) if ".prefetch:" in op.label]
     and [op for op in colls(base, _AG) if ".prefetch:" in op.label]),
    ("empty_gather_buffers", False,
     lambda s, base: len(_labels(s, O.Compute, ".zero_fill"))
     == len([op for op in colls(s, _AG) if ".prefetch:" in op.label]) > 0),
    ("preallocated_reduce_buffers", False,
     lambda s, base: {op.buffer for op in s.programs[0].step if isinstance(op, O.Alloc)} >= {"ipg_bucket0",
                                                                                           "ipg_bucket1", "grad16[0]"}
     and len(_labels(s, O.Copy, "store shard")) == _N_PARAMS
     and "ipg_bucket" not in {op.buffer for op in s.programs[0].setup}),
    # 0: the host waits for the last fetch event at every wait after the first, and for
    # the reduce stream at every flush (as 0.5.10 does, s3:2159-2160)
    ("max_outstanding_coalesced", 0,
     lambda s, base: len(_syncs(s, "fetch back-pressure")) == _params_gathered_async(s) - 1
     and len(_syncs(s, "reduction stream synchronize before the flush")) == len(colls(s, _RS))),
])
def test_each_knob_alone_changes_the_schedule_its_way(knob, value, check):
    md = describe(MODEL_PRESETS["tiny"], 2, 16)
    cfg = ds(stage3_max_reuse_distance=0, stage3_param_persistence_threshold=200, reduce_bucket_size=5000)
    base = generate(md, World(1, 2), cfg, KNOB_PRESETS["optimized"], preset="optimized")
    s = generate(md, World(1, 2), cfg, knobs_from("optimized", [f"{knob}={value}"]), preset="optimized")
    assert s != base
    assert validate(s) == []
    assert check(s, base)


def test_removed_and_renamed_knobs_say_why():
    from commsim.ir.errors import CommsimInputError
    with pytest.raises(CommsimInputError, match="flat_collectives is now flat_reduce_scatter"):
        knobs_from("optimized", ["flat_collectives=false"])
    with pytest.raises(CommsimInputError, match="defragment_persistent=false.*removed: neither DeepSpeed 0.5.10"):
        knobs_from("optimized", ["defragment_persistent=false"])


def test_ds_config_errors():
    from commsim.ir.errors import CommsimInputError
    with pytest.raises(CommsimInputError, match=r"zero_optimization.stage3_prefetch_bucket: unknown key"):
        parse_ds_config({"zero_optimization": {"stage3_prefetch_bucket": 5}})
    with pytest.raises(CommsimInputError, match=r"bf16.enabled: cannot be combined with fp16.enabled"):
        parse_ds_config({"bf16": {"enabled": True}, "fp16": {"enabled": True}})
    with pytest.raises(CommsimInputError, match=r"reduce_bucket_size: must be > 0, got 0"):
        parse_ds_config({"zero_optimization": {"reduce_bucket_size": 0}})
    cfg = parse_ds_config({"zero_optimization": {"stage": 3, "stage3_max_live_parameters": 3e7}, "colour": 1})
    assert cfg.zero.max_live_parameters == 30_000_000 and cfg.zero.overlap_comm is True
    assert cfg.warnings == ("ds_config: colour: not a DeepSpeed key commsim knows; ignored",)
    assert parse_ds_config({"zero_optimization": {"stage": 2}}).zero.overlap_comm is False


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_on_a_host_completing_backend_waits_for_its_blocking_collectives(stage):
    """DeepSpeed calls its reduce-scatters (reduce_scatter_coalesced), ZeRO-1/2's
    all-reduces and the updated partitions' all-gather with async_op=False; on gloo each
    blocks the host until done (host_blocking), while ZeRO-3's parameter all-gathers are
    asynchronous handles. Without host_blocking (NCCL) the schedule has no such waits."""
    md = describe(MODEL_PRESETS["tiny"], 2, 16)
    cfg = parse_ds_config({"zero_optimization": {"stage": stage}})
    by = {hb: generate(md, World(1, 2), cfg, knobs_from("current"), host_blocking=hb) for hb in (False, True)}
    assert not any(isinstance(op, O.HostSync) and "async_op=False" in op.label for op in by[False].programs[0].step)
    ops = list(by[True].programs[0].step)
    blocking = {O.CollectiveKind.REDUCE_SCATTER, O.CollectiveKind.ALL_REDUCE} if stage == 3 else \
        {O.CollectiveKind.ALL_REDUCE, O.CollectiveKind.ALL_GATHER}
    waited = [op for i, op in enumerate(ops) if isinstance(op, O.Collective) and isinstance(ops[i + 1], O.HostSync)
              and ops[i + 1].deps == (op.id,) and ops[i + 1].label == f"{op.label}: async_op=False, waited on the host"]
    assert waited and {op.kind for op in waited} <= blocking
    mine = [op for op in ops if isinstance(op, O.Collective) and op.kind in blocking and op.phase is not O.Phase.OPTIMIZER
            or isinstance(op, O.Collective) and op.label == "optimizer.allgather_params"]
    assert {op.id for op in mine} <= {op.id for op in waited}
    if stage == 3:
        assert colls(by[True], O.CollectiveKind.ALL_GATHER) and not any(
            op.kind is O.CollectiveKind.ALL_GATHER for op in waited)
    assert validate(by[True]) == []
    # the same collectives, in the same order
    same = [[(op.kind, op.size_bytes, op.label) for op in s.programs[0].step if isinstance(op, O.Collective)]
            for s in by.values()]
    assert same[0] == same[1]
