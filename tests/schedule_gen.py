"""Hypothesis strategies for random, valid schedules (shared by the IR and sim tests)."""

from __future__ import annotations

from hypothesis import strategies as st

from commsim.ir import ops as O
from commsim.ir.schedule import Program, Schedule, ScheduleMeta

STREAMS = ("compute", "allgather", "reduce")
NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_.", min_size=1, max_size=8)
LABELS = st.text(max_size=12)  # free text: spaces, quotes, unicode


@st.composite
def collective_plan(draw, world: int, full_groups: bool = False):
    """The group-wide sequence of collectives every member must issue (``full_groups``:
    every one over the whole world, so that all ranks can run one program)."""
    plan = []
    for _ in range(draw(st.integers(0, 6))):
        size = draw(st.sampled_from([1, 2, 3]))
        if full_groups:
            members = list(range(world))
        else:
            members = draw(st.lists(st.integers(0, world - 1), min_size=1, max_size=world, unique=True))
        group = tuple(sorted(members))
        kind = draw(st.sampled_from(list(O.CollectiveKind)))
        dtype = draw(st.sampled_from([O.DType.BF16, O.DType.FP32]))
        size_bytes = size * len(group) * dtype.itemsize_bytes * 64
        reduce_op = draw(st.sampled_from(list(O.ReduceOp))) if kind in (
            O.CollectiveKind.REDUCE_SCATTER, O.CollectiveKind.ALL_REDUCE) else None
        root = draw(st.sampled_from(group)) if kind is O.CollectiveKind.BROADCAST else None
        plan.append((kind, size_bytes, dtype, group, reduce_op, root))
    return plan


@st.composite
def rank_program(draw, rank: int, plan, next_id: list[int], max_ops: int = 8, max_persistent_bytes: int = 1 << 30,
                 stream_per_group: bool = False, max_tmp_bytes: int = 1 << 20, alloc_weight: int = 2):
    """One rank's program: its collectives of ``plan`` in plan order, between up to
    ``max_ops`` other ops (compute, copies, host work, host syncs of every scope, allocs);
    every step-local buffer (of up to ``max_tmp_bytes``) is freed at the end.
    ``stream_per_group``: all of a group's collectives on one stream (drawn per rank).
    ``alloc_weight``: how many of 5 + ``alloc_weight`` equally likely choices of an op are
    an allocation or a free."""

    def new_id() -> O.OpId:
        next_id[0] += 1
        return O.OpId(next_id[0])

    setup = []
    persistent = []
    for _ in range(draw(st.integers(0, 2))):
        name = f"p{len(persistent)}_" + draw(NAMES)
        setup.append(O.Alloc(new_id(), "compute", draw(LABELS), name, draw(st.integers(1, max_persistent_bytes))))
        persistent.append(name)
    step: list[O.Op] = []
    device_ids: list[O.OpId] = []
    live_tmp: list[str] = []
    my_colls = [c for c in plan if rank in c[3]]
    # sizes of step-local buffers: small-pool ones, and large-pool ones if allowed
    tmp_size = st.integers(1, min(max_tmp_bytes, 1 << 20))
    if max_tmp_bytes > 1 << 20:
        tmp_size = st.one_of(tmp_size, st.integers((1 << 20) + 1, max_tmp_bytes))
    # Always at least one step-local buffer, so buffer faults can be injected.
    tmp0 = "t0_" + draw(NAMES)
    step.append(O.Alloc(new_id(), draw(st.sampled_from(STREAMS)), draw(LABELS), tmp0, draw(tmp_size)))
    live_tmp.append(tmp0)
    n_tmp = 1  # step-local buffers so far: names stay unique after frees
    n_other = draw(st.integers(1, max_ops))
    slots = sorted(draw(st.lists(st.integers(0, n_other), min_size=len(my_colls), max_size=len(my_colls))))
    group_stream: dict[tuple[int, ...], str] = {}
    ci = 0
    for pos in range(n_other + 1):
        while ci < len(my_colls) and slots[ci] == pos:
            kind, size, dtype, group, rop, root = my_colls[ci]
            deps = tuple(draw(st.lists(st.sampled_from(device_ids), max_size=2, unique=True))) if device_ids else ()
            bufs = tuple(draw(st.lists(st.sampled_from(persistent + live_tmp), max_size=1, unique=True)))
            stream = draw(st.sampled_from(STREAMS))
            if stream_per_group:
                stream = group_stream.setdefault(group, stream)
            op = O.Collective(new_id(), stream, draw(LABELS), kind, size, dtype, group, rop, root, deps, bufs)
            step.append(op)
            device_ids.append(op.id)
            ci += 1
        if pos == n_other:
            break
        choice = draw(st.integers(0, 4 + alloc_weight))  # 5 and above: allocate or free
        if choice <= 1:
            flops = draw(st.integers(0, 10**9))
            gemm = None
            if choice == 1:
                m, n, k = draw(st.integers(1, 64)), draw(st.integers(1, 64)), draw(st.integers(1, 64))
                gemm = O.GemmShape(m, n, k)
                flops = gemm.flops
            deps = tuple(draw(st.lists(st.sampled_from(device_ids), max_size=2, unique=True))) if device_ids else ()
            bufs = tuple(draw(st.lists(st.sampled_from(persistent + live_tmp), max_size=2, unique=True)))
            rd, wr = draw(st.integers(1, 10**6)), draw(st.integers(0, 10**6))
            reuse = draw(st.one_of(st.just(0), st.integers(0, rd + wr)))  # stated reuse, or none
            op = O.Compute(new_id(), draw(st.sampled_from(STREAMS)), draw(LABELS),
                           draw(st.sampled_from(list(O.ComputeKind))), flops, rd, wr, gemm, deps, bufs,
                           reuse_bytes=reuse, working_set_bytes=draw(st.integers(0, 10**7)) if reuse else 0)
            step.append(op)
            device_ids.append(op.id)
        elif choice == 2:
            op = O.Copy(new_id(), draw(st.sampled_from(STREAMS)), draw(LABELS),
                        draw(st.sampled_from(list(O.CopyDirection))), draw(st.integers(1, 10**6)))
            step.append(op)
            device_ids.append(op.id)
        elif choice == 3:
            step.append(O.HostWork(new_id(), draw(LABELS), draw(st.sampled_from(list(O.HostKind))),
                                   draw(st.integers(0, 10**6))))
        elif choice == 4:
            scope = draw(st.sampled_from(list(O.SyncScope)))
            if scope is O.SyncScope.OPS and device_ids:
                deps = tuple(draw(st.lists(st.sampled_from(device_ids), min_size=1, max_size=3, unique=True)))
                step.append(O.HostSync(new_id(), draw(LABELS), scope, deps=deps))
            elif scope is O.SyncScope.STREAM:
                step.append(O.HostSync(new_id(), draw(LABELS), scope, stream=draw(st.sampled_from(STREAMS))))
            else:
                step.append(O.HostSync(new_id(), draw(LABELS), O.SyncScope.DEVICE))
        elif len(live_tmp) > 1 and draw(st.booleans()):
            # free a buffer mid-step (not t0: it lives to the end), so that later
            # allocations can reuse or flush its block
            name = draw(st.sampled_from(live_tmp[1:]))
            step.append(O.Free(new_id(), draw(st.sampled_from(STREAMS)), draw(LABELS), name))
            live_tmp.remove(name)
        else:
            n_tmp += 1
            name = f"t{n_tmp}_" + draw(NAMES)
            step.append(O.Alloc(new_id(), draw(st.sampled_from(STREAMS)), draw(LABELS), name,
                                draw(tmp_size)))
            live_tmp.append(name)
    for name in live_tmp:
        step.append(O.Free(new_id(), draw(st.sampled_from(STREAMS)), draw(LABELS), name))
    return Program(setup=tuple(setup), step=tuple(step))


@st.composite
def schedules(draw, min_world: int = 1, max_world: int = 4, shared: bool | None = None, full_groups: bool = False,
              max_ops: int = 8, max_persistent_bytes: int = 1 << 30, stream_per_group: bool = False,
              max_tmp_bytes: int = 1 << 20, alloc_weight: int = 2):
    """A valid schedule of ``min_world``..``max_world`` ranks. ``shared``: one program for
    every rank (possible only when every collective spans the world; None: drawn); the
    other arguments as for ``collective_plan`` and ``rank_program``."""
    world = draw(st.integers(min_world, max_world))
    plan = draw(collective_plan(world, full_groups))
    share = draw(st.booleans()) if shared is None else shared
    meta = ScheduleMeta(
        model=draw(NAMES), strategy=draw(LABELS),
        knobs=tuple(draw(st.dictionaries(NAMES, st.one_of(st.booleans(), st.integers(-5, 5), NAMES),
                                         max_size=3)).items()),
        generator="hypothesis", description=draw(LABELS),
    )
    if share and all(len(c[3]) == world for c in plan):
        prog = draw(rank_program(0, plan, [0], max_ops, max_persistent_bytes, stream_per_group,
                                     max_tmp_bytes, alloc_weight))
        return Schedule.uniform(world, prog, meta)
    programs = [draw(rank_program(r, plan, [0], max_ops, max_persistent_bytes, stream_per_group,
                                     max_tmp_bytes, alloc_weight)) for r in range(world)]
    return Schedule.from_rank_programs(programs, meta)
