"""The ZeRO-3 lowering's parts on their own: coordinator, reducer, persistence, sub-groups."""

from dataclasses import fields, replace

from commsim.ir import ops as O
from commsim.ir.ops import Phase
from commsim.models import MODEL_PRESETS, describe
from commsim.models.spec import ParamSpec
from commsim.strategies import zero3, zero3_trace
from commsim.strategies.builder import ProgramBuilder
from commsim.strategies.dsconfig import parse_ds_config
from commsim.strategies.groups import rank_groups
from commsim.strategies.knobs import HostCosts, Knobs
from commsim.strategies.zero3_grads import GradReducer
from commsim.strategies.zero3_layout import Zero3Layout
from commsim.strategies.zero3_optimizer import sub_groups
from commsim.strategies.zero3_params import AVAILABLE, NA, ParamCoordinator, persistent_params


def test_zero3_still_exports_the_trace():
    for name in ("module_trace", "TraceEntry", "CHECKPOINT_STYLES"):
        assert getattr(zero3, name) is getattr(zero3_trace, name)


def _p(name, numel):
    return ParamSpec(name, (numel,))


def test_persistent_params_fill_the_model_budget_per_rank_in_ds_order():
    params = (_p("a", 10), _p("big", 200), _p("c", 30), _p("d", 40), _p("e", 5))
    # threshold 50 excludes big; budget 80 // 2 ranks = 40: a and c fit, d not, e still does
    assert persistent_params(params, 50, 80, 2) == {"a", "c"}
    assert persistent_params(params, 50, 10**9, 2) == {"a", "c", "d", "e"}
    assert persistent_params(params, 0, 10**9, 2) == frozenset()


def test_sub_groups_close_at_the_parameter_that_fills_them():
    # _create_fp16_sub_groups: a group ends with the parameter that brings it to the
    # size or beyond; one group when everything fits; sizes are the rank's partitions
    a, b, c, d = _p("a", 5), _p("b", 20), _p("c", 3), _p("d", 4)
    assert sub_groups((a, b, c, d), 10) == [[a, b], [c, d]]
    assert sub_groups((b, a), 10) == [[b], [a]]
    assert sub_groups((a, b, c, d), 32) == [[a, b, c, d]]
    assert sub_groups((a, b, c, d), 10, {"a": 3, "b": 3, "c": 4, "d": 1}) == [[a, b, c], [d]]


def _costs() -> HostCosts:
    """Launches and the two hooks priced, every other host cost zero: exact logs that
    do not move when measured costs do."""
    keep = {"launch_ns": 6_000, "collective_launch_ns": 20_000, "module_hook_ns": 30_000, "grad_hook_ns": 10_000}
    return replace(HostCosts(), **{f.name: keep.get(f.name, 0) for f in fields(HostCosts)})


def _parts(**zero):
    md = describe(MODEL_PRESETS["tiny"], 1, 4)
    z = parse_ds_config({"bf16": {"enabled": True}, "zero_optimization": {"stage": 3, **zero}}).zero
    layout = Zero3Layout.build(md.registered_params(), rank_groups(0, 2, 2), 2, O.DType.BF16, overlap_comm=True,
                               offload=False, hpz=1)
    return md, z, layout, ProgramBuilder()


def _log(ops):
    return [(type(op).__name__, op.label) for op in ops]


def test_coordinator_alone_gathers_coalesced_waits_with_back_pressure_and_releases():
    md, z, layout, b = _parts(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=0,
                              stage3_max_reuse_distance=0)
    trace = zero3_trace.module_trace(md, False)
    coord = ParamCoordinator(b, layout, z, Knobs(), _costs(), trace)
    coord.reset_micro_step()
    ln = "roberta.embeddings.LayerNorm"
    for i, e in enumerate(trace):
        b.phase = e.phase
        start = len(b.step)
        deps = coord.fetch(i, e) if e.fetch else ()
        if e.release:
            coord.release(i + 1, e)
        if e.module.path == ln:
            break
    # three single-parameter gathers came first (word, token type, position embeddings),
    # each leaving a fetch event: the 4th and 5th wait block on the oldest of three
    step = b.step[start:]
    assert _log(step) == [
        ("HostWork", f"hook {ln}"),
        ("Alloc", f"gathered {ln}.weight"),
        ("Alloc", f"gathered {ln}.bias"),
        ("Alloc", "coalesced all-gather buffer 4"),
        ("HostWork", "launch"),
        ("Copy", "ag4.copy_in"),
        ("HostWork", "all_gather launch"),
        ("Collective", f"fwd.ag4.fetch:{ln}.weight+1"),
        ("HostSync", "fetch back-pressure: oldest outstanding all-gather"),
        ("HostWork", "launch"),
        ("Copy", f"unflatten {ln}.weight+1"),
        ("Free", "coalesced all-gather buffer"),
        ("HostSync", "fetch back-pressure: oldest outstanding all-gather"),
        ("Free", f"release {ln}.weight"),
        ("Free", f"release {ln}.bias"),
    ]
    ag = step[7]
    assert ag.size_bytes == 2 * 32 * 2 * 2 and ag.group == (0, 1) and ag.stream == "allgather"
    assert deps == (step[10].id,)  # the first kernel waits on the whole all-gather stream
    assert coord.status[f"{ln}.weight"] == NA and coord.n_available == 0


def test_reducer_alone_flushes_before_the_bucket_would_overflow():
    md, z, layout, b = _parts(reduce_bucket_size=100)
    trace = zero3_trace.module_trace(md, False)
    ln = next(m for m in md.modules if m.path == "roberta.embeddings.LayerNorm")
    grads = GradReducer(b, layout, z, Knobs(), _costs(), trace)
    grads.reset_micro_step(at_boundary=True)
    b.phase = Phase.BACKWARD
    assert grads.before_backward(ln) == (f"grad:{ln.path}.weight", f"grad:{ln.path}.bias")
    grads.after_backward(ln)
    grads.epilogue()
    w, bias = f"{ln.path}.weight", f"{ln.path}.bias"
    assert _log(b.step) == [
        ("Alloc", f"gradient {w}"),
        ("Alloc", f"gradient {bias}"),
        ("HostWork", f"grad hook {w}"),
        ("HostWork", "launch"),
        ("Copy", f"grad to bucket {w}"),
        ("Free", f"gradient {w} (now in the bucket)"),
        # 64 + 64 elements > 100: the weight's bucket goes first; 64 divides over 2
        # ranks, so the lone gradient needs no interleaving, only the pre-divide (cc:94)
        ("HostWork", f"grad hook {bias}"),
        ("HostWork", "launch"),
        ("Compute", "rs1.divide"),
        ("HostWork", "reduce_scatter launch"),
        ("Collective", f"bwd.rs1:{w}"),
        ("HostWork", "launch"),
        ("Compute", "rs1.partition_grads"),
        ("HostWork", "launch"),
        ("Copy", f"grad to bucket {bias}"),
        ("Free", f"gradient {bias} (now in the bucket)"),
        ("HostWork", "launch"),
        ("Compute", "rs2.divide"),
        ("HostWork", "reduce_scatter launch"),
        ("Collective", f"bwd.rs2:{bias}"),
        ("HostWork", "launch"),
        ("Compute", "rs2.partition_grads"),
        ("HostSync", "end of backward: wait for gradient reduction"),
    ]
    assert grads.live_grads == set() and grads.bucket == []


def test_coordinator_persistent_parameters_start_available_and_are_regathered_after_the_step():
    md, z, layout, b = _parts()  # DeepSpeed's default threshold: all of tiny's parameters persist
    coord = ParamCoordinator(b, layout, z, Knobs(), _costs(), zero3_trace.module_trace(md, False))
    assert all(s == AVAILABLE for s in coord.status.values())
    coord.release_all()
    assert all(s == NA for s in coord.status.values())
    coord.gather_persistent()
    ags = [op for op in b.step if isinstance(op, O.Collective)]
    assert len(ags) == len(layout.params) and all(s == AVAILABLE for s in coord.status.values())
    # on the default stream, then a device-wide synchronize (0.19.8's
    # _allgather_params_coalesced, like 0.5.10's pp:984 and 0.6.0's pp:1310)
    assert {op.stream for op in ags} == {"compute"}
    assert isinstance(b.step[-1], O.HostSync) and b.step[-1].scope is O.SyncScope.DEVICE
