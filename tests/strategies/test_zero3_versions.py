"""The DeepSpeed releases the ZeRO-3 generator follows, checked against replays of
their parameter coordinators written here from the released sources (not from the
generator): DeepSpeed 0.6.0 (stage3.py:172-493, the ``optimized`` preset) and 0.5.10
(stage3.py:157-543 with partition_parameters.py, the ``baseline``), and 0.5.4 (the same
coordinator with PR 1188's gather and release paths undone, ``before-pr1188``) against
0.5.10's schedule. 0.19.8 (``current``)
is checked against the real DeepSpeed in tests/runtime/test_deepspeed_fidelity.py."""

from collections import Counter, deque

import pytest

from commsim.api import Scenario, build_schedule
from commsim.ir import ops as O
from commsim.ir.validate import validate
from commsim.models import MODEL_PRESETS, describe
from commsim.strategies import World, generate
from commsim.strategies.dsconfig import parse_ds_config
from commsim.strategies.dsversions import VERSIONS, apply_version_rules, version_of
from commsim.strategies.knobs import KNOB_PRESETS, host_costs_for
from commsim.strategies.zero3_trace import module_trace

AG = O.CollectiveKind.ALL_GATHER


def _cfg(precision="bf16", **zero):
    return parse_ds_config({precision: {"enabled": True}, "zero_optimization": {"stage": 3, **zero}})


def _unique(params):
    return list({p.name: p for p in params}.values())


def _gathers(s):
    """(why, names) of each fetch / prefetch all-gather, in program order."""
    out = []
    for op in s.programs[0].step:
        if isinstance(op, O.Collective) and op.kind is AG and (".fetch:" in op.label or ".prefetch:" in op.label):
            why = "prefetch" if ".prefetch:" in op.label else "fetch"
            first, _, more = op.label.rsplit(":", 1)[1].partition("+")
            out.append((why, first, 1 + int(more or 0)))
    return out


# ---------------------------------------------------------------- 0.6.0


def replay_060(md, z, world):
    """0.6.0's coordinator over the hook trace: persistence ds_numel < threshold
    (s3:1388); fetch gathers the module's unavailable parameters in one call
    (s3:313, 420-435) and waits; prefetch pops the module's own queue entries, then up
    to min(max_live - available, bucket) elements, counting every newly popped
    parameter, available or not (s3:366-377), and gathers the unavailable ones in one
    call; release per parameter unless used within max_reuse_distance elements, the
    scan stopping once more than that was traversed (s3:444-466), and only parameters
    no open module holds (s3:437-442). Returns (why, first name, count) per call."""
    trace = module_trace(md, True)
    params = {p.name: p for p in md.registered_params()}
    ds_id = {n: i for i, n in enumerate(params)}
    persist = {n for n, p in params.items() if p.numel < z.param_persistence_threshold}
    status = {n: ("A" if n in persist else "N") for n in params}
    fetches = [(i, e) for i, e in enumerate(trace) if e.fetch]
    order = [(p.name, i) for i, e in fetches for p in sorted(_unique(e.module.params), key=lambda q: ds_id[q.name])]
    queue, recent = deque(order), {n: -10**10 for n in params}
    active = {n: set() for n in params}
    avail, calls = 0, []

    def gather(names, why):
        nonlocal avail
        names = sorted((n for n in names if status[n] == "N"), key=ds_id.get)
        if names:
            calls.append((why, names[0], len(names)))
            for n in names:
                status[n] = "I"
                avail += params[n].numel

    for i, e in enumerate(trace):
        m = e.module
        if e.fetch:
            names = [p.name for p in _unique(m.params)]
            gather(names, "fetch")
            for n in names:
                active[n].add(m.path)
                if status[n] == "I":
                    status[n] = "A"
            not_fetched = {n for n in names if recent[n] < i}
            popped = set()
            while queue and len(popped) < len(not_fetched):
                n, at = queue.popleft()
                recent[n] = at
                popped.add(n)
            budget, numel, chosen = min(z.max_live_parameters - avail, z.prefetch_bucket_size), 0, []
            while queue and numel < budget:
                n, at = queue.popleft()
                recent[n] = at
                if n not in chosen:
                    chosen.append(n)
                    numel += params[n].numel
            gather(chosen, "prefetch")
        if e.release:
            release = {p.name for p in m.params if p.name not in persist}
            traversed = 0
            for later in trace[i + 1:]:
                if not later.fetch:
                    continue
                if traversed > z.max_reuse_distance:
                    break
                for p in later.module.params:
                    release.discard(p.name)
                    traversed += p.numel
            for p in _unique(m.params):
                active[p.name].discard(m.path)
                if p.name in release and status[p.name] == "A" and not active[p.name]:
                    status[p.name] = "N"
                    avail -= params[p.name].numel
    return calls


CONFIGS = [
    {},
    {"stage3_param_persistence_threshold": 200},
    {"stage3_param_persistence_threshold": 200, "stage3_prefetch_bucket_size": 3000, "stage3_max_reuse_distance": 0},
    {"stage3_param_persistence_threshold": 100, "stage3_prefetch_bucket_size": 10000,
     "stage3_max_live_parameters": 30000, "stage3_max_reuse_distance": 5000},
    {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0},
]


@pytest.mark.parametrize("zero", CONFIGS)
def test_optimized_gathers_what_deepspeed_060_gathers(zero):
    md = describe(MODEL_PRESETS["tiny"], 2, 16)
    cfg = _cfg(**zero)
    s = generate(md, World(1, 2), cfg, KNOB_PRESETS["optimized"], preset="optimized")
    assert validate(s) == []
    assert _gathers(s) == replay_060(md, cfg.zero, 2)


def test_optimized_on_roberta_10b_matches_the_research_replay():
    # /work/research/deepspeed-zero3-versions.md section 4.2: 284 all-gather calls per
    # step for roberta-10b on 64 ranks (2 demand, 282 prefetch; 185 of one parameter)
    s, *_ = build_schedule(Scenario(preset="optimized"))
    g = _gathers(s)
    assert len(g) == 284
    assert Counter(why for why, _, _ in g) == {"fetch": 2, "prefetch": 282}
    assert sum(1 for _, _, n in g if n == 1) == 185
    md = describe(MODEL_PRESETS["roberta-10b"], 16, 512)
    assert g == replay_060(md, _cfg().zero, 64)


# ---------------------------------------------------------------- 0.5.10


def replay_0510(md, z):
    """0.5.10 as it runs: its trace is one position off the step counter (the root's
    reset_step hook runs after the root's own fetch hook), so nothing is prefetched and
    nothing kept for reuse. A fetch gathers each unavailable parameter on its own
    (_allgather_params_coalesced, pp:919-986); a release partitions each non-persistent
    parameter no open module holds (s3:461-502). Returns the gathers and, per fetch,
    whether it gathered."""
    trace = module_trace(md, True)
    params = {p.name: p for p in md.registered_params()}
    persist = {n for n, p in params.items() if p.numel < z.param_persistence_threshold}
    status = {n: ("A" if n in persist else "N") for n in params}
    active = Counter()
    gathers, fetch_gathered = [], []
    for e in trace:
        m = e.module
        if e.fetch:
            names = [p.name for p in _unique(m.params)]
            need = [n for n in sorted(names, key=list(params).index) if status[n] == "N"]
            gathers.extend(("fetch", n, 1) for n in need)
            fetch_gathered.append(bool(need))
            for n in names:
                active[n] += 1
                status[n] = "A"
        if e.release:
            for p in _unique(m.params):
                active[p.name] -= 1
                if active[p.name] == 0 and p.name not in persist:
                    status[p.name] = "N"
    return gathers, fetch_gathered


@pytest.mark.parametrize("zero", CONFIGS[:3])
def test_baseline_gathers_every_use_on_demand_with_device_syncs(zero):
    md = describe(MODEL_PRESETS["tiny"], 2, 16)
    cfg = _cfg("fp16", **zero)
    s = generate(md, World(1, 2), cfg, KNOB_PRESETS["baseline"], preset="baseline")
    assert validate(s) == []
    gathers, gathered = replay_0510(md, cfg.zero)
    assert _gathers(s) == gathers
    step = s.programs[0].step
    syncs = Counter(op.label.split(" (")[0] for op in step if isinstance(op, O.HostSync))
    # per fetch that gathers: torch.cuda.synchronize after the gathers (pp:984), then
    # _synchronize_communication's stream and device synchronizes (s3:541-542)
    assert syncs["demand all-gather: torch.cuda.synchronize()"] == sum(gathered)
    assert syncs["fetch: all-gather stream synchronize"] == sum(gathered)
    assert syncs["fetch: torch.cuda.synchronize()"] == sum(gathered)
    # the debug norm of every parameter of every fetched module, each read by the host
    n_visits = sum(len(_unique(e.module.params)) for e in module_trace(md, True) if e.fetch)
    assert syncs["debug string: .item() of param.norm()"] == n_visits
    n = len(md.registered_params())
    # the overflow check reads each gradient's sum, then gpu_sum (s3:2861-2862)
    assert sum(v for k, v in syncs.items() if k.startswith("float() of") and "gpu_sum" not in k) == n
    assert syncs["float() of gpu_sum"] == 1
    assert sum(v for k, v in syncs.items() if k.startswith(".item() of")) == n  # norms
    # one reduce-scatter per gradient through the list API (a flatten copy each)
    rs = [op for op in step if isinstance(op, O.Collective) and op.kind is O.CollectiveKind.REDUCE_SCATTER]
    assert len(rs) == len(md.unique_params())
    flat = [i for i, op in enumerate(step) if isinstance(op, O.Copy) and ".flatten_list" in op.label]
    assert len(flat) == len(rs)
    # ... one copy_ per rank's piece, each launched from the host (flatten_for_scatter_gather)
    launches = [next(op for op in reversed(step[:i]) if isinstance(op, O.HostWork)) for i in flat]
    assert {(op.kind, op.duration_ns) for op in launches} == {(O.HostKind.LAUNCH,
                                                               2 * host_costs_for("0.5.10").launch_ns)}
    # no prefetch, so no zero-filled prefetch buffers and no pre-launch synchronizes
    assert not [op for op in step if isinstance(op, O.Compute) and op.label.endswith(".zero_fill")]
    assert not syncs["before the prefetch all-gather"]


def test_baseline_reduce_path_allocates_per_step_and_divides_the_whole_bucket():
    md = describe(MODEL_PRESETS["tiny"], 2, 16)
    cfg = _cfg("fp16", reduce_bucket_size=20000)
    s = generate(md, World(1, 2), cfg, KNOB_PRESETS["baseline"], preset="baseline")
    prog = s.programs[0]
    assert "ipg_bucket" not in {a.buffer for a in prog.setup} and "grad16[0]" not in {a.buffer for a in prog.setup}
    allocs = {op.buffer: op for op in prog.step if isinstance(op, O.Alloc)}
    # two bucket buffers (overlap_comm) of reduce_bucket_size elements, made per backward
    assert allocs["ipg_bucket0"].size_bytes == allocs["ipg_bucket1"].size_bytes == 20000 * 2
    divides = [op for op in prog.step if isinstance(op, O.Compute) and op.label.startswith("rs.divide:ipg_bucket")]
    flushes = [op for op in prog.step if isinstance(op, O.HostSync) and "before the flush" in op.label]
    assert divides and all(op.bytes_read == 20000 * 2 for op in divides)
    # the bucket copies run on the compute stream; the shards are stored on a stream of their own
    assert {op.stream for op in prog.step if isinstance(op, O.Copy) and op.label.startswith("grad to bucket")} == {
        "compute"}
    assert {op.stream for op in prog.step if isinstance(op, O.Copy) and op.label.startswith("store shard")} == {
        "copy_grad"}
    assert len(flushes) == len(divides)
    assert validate(s) == []


def test_baseline_runs_fp16_and_says_why():
    ds, notes = apply_version_rules(_cfg("bf16"), version_of("baseline"))
    assert ds.precision == "fp16" and "deepspeed/runtime/config.py:902" in notes[0]
    for preset in ("optimized", "current"):
        assert apply_version_rules(_cfg("bf16"), version_of(preset)) == (_cfg("bf16"), [])
    sc = Scenario(model="tiny", nodes=1, gpus_per_node=2, seq=16, preset="baseline")
    sched, *_ = build_schedule(sc)
    assert sched.meta.precision == "fp16" and any("config.py:902" in w for w in sc.warnings)
    assert dict(sched.meta.config)["deepspeed"] == "0.5.10"


def test_presets_name_their_releases():
    assert {p: version_of(p).name for p in KNOB_PRESETS} == {"current": "0.19.8", "optimized": "0.6.0",
                                                             "baseline": "0.5.10", "before-pr1188": "0.5.4"}
    assert set(VERSIONS) == {"0.5.4", "0.5.10", "0.6.0", "0.19.8"}


@pytest.mark.parametrize("zero", CONFIGS[:3])
def test_before_pr1188_takes_the_per_parameter_gather_and_a_host_copy_per_release(zero):
    """0.5.4 = 0.5.10's coordinator (the same gathers, in the same order), each demand
    gather through _allgather_param (pp:835-880): a zero-filled buffer, a device
    synchronize before it, the shard copied in, the list all_gather (ProcessGroupNCCL's
    own flat output, copied out); every release a torch.ones(1).to(device) the host
    waits for (pp:728); the persistent parameters gathered once, copied out in Python
    (pp:884-938), with no synchronize after."""
    md = describe(MODEL_PRESETS["tiny"], 2, 16)
    cfg = _cfg("fp16", **zero)
    s = generate(md, World(1, 2), cfg, KNOB_PRESETS["before-pr1188"], preset="before-pr1188")
    base = generate(md, World(1, 2), cfg, KNOB_PRESETS["baseline"], preset="baseline")
    assert validate(s) == []
    gathers, gathered = replay_0510(md, cfg.zero)
    assert _gathers(s) == _gathers(base) == gathers
    step = s.programs[0].step
    syncs = Counter(op.label.split(" (")[0] for op in step if isinstance(op, O.HostSync))
    fetch_ag = [op for op in step if isinstance(op, O.Collective) and ".fetch:" in op.label]
    assert len(fetch_ag) == len(gathers) and all(n == 1 for _, _, n in gathers)
    # one synchronize before each gather, none after the launches; then, per fetch that
    # gathers, _synchronize_communication's two (s3:540-541)
    assert sum(v for k, v in syncs.items() if k.endswith("before the fetch all-gather")) == len(fetch_ag)
    assert not syncs["demand all-gather: torch.cuda.synchronize()"]
    assert syncs["fetch: torch.cuda.synchronize()"] == sum(gathered)
    by_label = {op.label: op for op in step}
    for ag in fetch_ag:
        k = ag.label.split(".ag", 1)[1].split(".", 1)[0]
        assert by_label[f"ag{k}.zero_fill"].bytes_written == ag.size_bytes
        out = by_label[ag.label + ".copy_out"]
        assert isinstance(out, O.Copy) and out.size_bytes == ag.size_bytes and out.stream == ag.stream
        assert ag.buffers[0].startswith("aglist[")  # NCCL writes its own flat output
    # a host copy and wait per released parameter: as many as the baseline's releases
    frees = [op for op in base.programs[0].step if isinstance(op, O.Free) and op.label.startswith("release ")]
    assert syncs["release: torch.ones(1).to(device)"] == len(frees) > 0
    h2d = [op for op in step if isinstance(op, O.Copy) and op.label.startswith("release.ones_h2d:")]
    assert len(h2d) == len(frees) and {(op.direction, op.size_bytes) for op in h2d} == {(O.CopyDirection.H2D, 2)}
    # the persistent parameters: one list all_gather, one copy out per parameter, no sync
    pers = [op for op in step if isinstance(op, O.Collective) and ".persistent:" in op.label]
    n_pers = sum(1 for op in base.programs[0].step if isinstance(op, O.Collective) and ".persistent:" in op.label)
    assert len(pers) == 1 and n_pers > 1
    assert len([op for op in step if isinstance(op, O.Copy) and ".copy_out:" in op.label]) == n_pers
    assert not syncs["synchronous gather of persistent parameters: torch.cuda.synchronize()"]
    # the gradient path is 0.5.10's
    rs = [op.label for op in step if isinstance(op, O.Collective) and op.kind is O.CollectiveKind.REDUCE_SCATTER]
    assert rs == [op.label for op in base.programs[0].step
                  if isinstance(op, O.Collective) and op.kind is O.CollectiveKind.REDUCE_SCATTER]


def test_before_pr1188_runs_fp16_and_is_slower_than_the_baseline():
    ds, notes = apply_version_rules(_cfg("bf16"), version_of("before-pr1188"))
    assert ds.precision == "fp16" and "has no bf16" in notes[0] and "before-pr1188" in notes[0]
    from commsim.api import predict
    t = {p: predict(Scenario(model="tiny", nodes=1, gpus_per_node=8, seq=64, micro_batch=4, preset=p,
                             mode="symmetric")).metrics.step_time_s for p in ("before-pr1188", "baseline")}
    assert t["before-pr1188"] > t["baseline"]
