"""Schedule validation: would this schedule run on a real cluster, and run correctly?

Checks, in order, reporting each problem with the rank, the op's index and its text:

* structure: unique op ids, well-formed names, positive sizes, consistent fields
  (a gemm's flops equal its shape's, reduce ops only on reductions, roots in groups);
* dependencies: every dep names an op of the same rank, the graph of deps and stream
  order is acyclic, and no op waits on an op issued after it (a real CUDA stream
  cannot wait on an event that has not been recorded yet; a host sync on it would
  block forever);
* buffers: allocated before use, never allocated twice while live, freed at most once,
  and the step ends with the same live buffers (and sizes) it began with: steady state
  (otherwise memory grows or state is lost every step);
* collectives: every member of a group issues that group's collectives in the same
  order with the same kind, size, dtype, reduce op and root; otherwise a real run
  hangs or corrupts data.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from commsim.ir import ops as O
from commsim.ir.errors import ScheduleInvalidError
from commsim.ir.schedule import Program, Schedule
from commsim.ir.text import op_to_text


@dataclass(frozen=True, slots=True)
class Finding:
    """One problem: which check, where (rank, section, index), and the op's text."""

    check: str
    message: str
    rank: int | None = None
    section: str | None = None  # "setup" or "step"
    op_index: int | None = None
    op_text: str | None = None

    def line(self) -> str:
        where = []
        if self.rank is not None:
            where.append(f"rank {self.rank}")
        if self.op_index is not None:
            where.append(f"{self.section} op {self.op_index}")
        head = ", ".join(where)
        text = f" `{self.op_text}`" if self.op_text else ""
        return f"{head}{':' if head else ''} {self.check}: {self.message}{text}".strip()


class _Located:
    """Maps op ids of one program to (section, index, op)."""

    def __init__(self, program: Program):
        self.where: dict[O.OpId, tuple[str, int, O.Op]] = {}
        self.duplicates: list[tuple[str, int, O.Op]] = []
        for section, seq in (("setup", program.setup), ("step", program.step)):
            for i, op in enumerate(seq):
                if op.id in self.where:
                    self.duplicates.append((section, i, op))
                else:
                    self.where[op.id] = (section, i, op)

    def order(self, op_id: O.OpId) -> tuple[int, int]:
        section, index, _ = self.where[op_id]
        return (0 if section == "setup" else 1, index)


def _finding(check: str, msg: str, rank: int, section: str, index: int, op: O.Op) -> Finding:
    return Finding(check, msg, rank, section, index, op_to_text(op))


def _check_structure(program: Program, rank: int, world: int) -> list[Finding]:
    out: list[Finding] = []
    for section, seq in (("setup", program.setup), ("step", program.step)):
        for i, op in enumerate(seq):
            def bad(msg: str, check: str = "structure") -> None:
                out.append(_finding(check, msg, rank, section, i, op))

            for attr in ("stream", "buffer"):
                value = getattr(op, attr, None)
                if value is not None:
                    try:
                        O.check_name(value, attr)
                    except ValueError as e:
                        bad(str(e))
            for b in O.op_buffers(op):
                try:
                    O.check_name(b, "buffer")
                except ValueError as e:
                    bad(str(e))
            if isinstance(op, O.Compute):
                if op.flops < 0 or op.bytes_read < 0 or op.bytes_written < 0:
                    bad("flops and bytes must not be negative", "size")
                elif op.flops + op.bytes_read + op.bytes_written == 0:
                    bad("a compute op must do some flops or move some bytes", "size")
                if not 0 <= op.reuse_bytes <= op.bytes_read + op.bytes_written:
                    bad(f"reuse_bytes must be within 0..bytes_read + bytes_written "
                        f"({op.bytes_read + op.bytes_written}), got {op.reuse_bytes}", "size")
                if not 0 <= op.in_place_bytes <= op.bytes_written:
                    bad(f"in_place_bytes must be within 0..bytes_written ({op.bytes_written}), "
                        f"got {op.in_place_bytes}", "size")
                if op.working_set_bytes < 0:
                    bad(f"working_set_bytes must not be negative, got {op.working_set_bytes}", "size")
                if op.gemm is not None and op.kind is O.ComputeKind.GEMM:
                    g = op.gemm
                    if min(g.m, g.n, g.k, g.batch) <= 0:
                        bad("gemm dimensions must be positive", "size")
                    elif g.flops != op.flops:  # a GEMM is exactly its shape
                        bad(f"flops {op.flops} differ from its gemm shape's {g.flops}")
            elif isinstance(op, O.Collective):
                out.extend(_check_collective(op, rank, world, section, i))
            elif isinstance(op, (O.Copy, O.Alloc)):
                if op.size_bytes <= 0:
                    bad(f"size_bytes must be positive, got {op.size_bytes}", "size")
                elif isinstance(op, O.Alloc) and op.touch_bytes is not None and not 0 <= op.touch_bytes <= op.size_bytes:
                    bad(f"touch_bytes must be within 0..size_bytes ({op.size_bytes}), got {op.touch_bytes}", "size")
            elif isinstance(op, O.HostWork):
                if op.duration_ns < 0:
                    bad("duration_ns must not be negative", "size")
            elif isinstance(op, O.HostSync):
                if op.scope is O.SyncScope.OPS and (not op.deps or op.stream is not None):
                    bad("an ops-scoped sync names the ops it waits for in deps, and no stream")
                if op.scope is O.SyncScope.STREAM and (op.stream is None or op.deps):
                    bad("a stream-scoped sync names its stream and no deps")
                if op.scope is O.SyncScope.DEVICE and (op.stream is not None or op.deps):
                    bad("a device-wide sync names no stream and no deps")
    return out


def _check_collective(op: O.Collective, rank: int, world: int, section: str, i: int) -> list[Finding]:
    msgs = []
    g = op.group
    if not g:
        msgs.append("group is empty")
    elif list(g) != sorted(set(g)) or g[0] < 0 or g[-1] >= world:
        msgs.append(f"group must be distinct ascending ranks in 0..{world - 1}")
    item = op.dtype.itemsize_bytes
    if op.size_bytes <= 0:
        msgs.append(f"size_bytes must be positive, got {op.size_bytes}")
    elif op.size_bytes % item:
        msgs.append(f"size_bytes {op.size_bytes} is not a whole number of {op.dtype.value} elements")
    elif op.kind in (O.CollectiveKind.ALL_GATHER, O.CollectiveKind.REDUCE_SCATTER) and g:
        if op.size_bytes % (item * len(g)):
            msgs.append(f"size_bytes {op.size_bytes} does not split into {len(g)} equal shards")
    reducing = op.kind in (O.CollectiveKind.REDUCE_SCATTER, O.CollectiveKind.ALL_REDUCE)
    if reducing and op.reduce_op is None:
        msgs.append(f"{op.kind.value} needs a reduce_op")
    if not reducing and op.reduce_op is not None:
        msgs.append(f"{op.kind.value} takes no reduce_op")
    if op.kind is O.CollectiveKind.BROADCAST:
        if op.root is None or op.root not in g:
            msgs.append("broadcast needs a root in its group")
    elif op.root is not None:
        msgs.append(f"{op.kind.value} takes no root")
    return [_finding("collective", m, rank, section, i, op) for m in msgs]


def _check_membership(program: Program, ranks: list[int]) -> list[Finding]:
    """Every rank running the program must belong to each group it issues on."""
    first: dict[tuple[int, ...], tuple[int, O.Collective]] = {}
    for i, op in enumerate(program.step):
        if isinstance(op, O.Collective) and op.group not in first:
            first[op.group] = (i, op)
    out = []
    for group, (i, op) in first.items():
        members = set(group)
        for r in ranks:
            if r not in members:
                out.append(_finding("collective", f"rank {r} issues a collective of a group it is not in", r, "step", i, op))
                break
    return out


def _check_deps(program: Program, rank: int) -> list[Finding]:
    out: list[Finding] = []
    loc = _Located(program)
    for section, i, op in loc.duplicates:
        out.append(_finding("structure", f"op id {op.id} is used twice", rank, section, i, op))
    for section, seq in (("setup", program.setup), ("step", program.step)):
        for i, op in enumerate(seq):
            for d in O.op_deps(op):
                # name the op by its id, as deps do: its index (the location) differs from it
                if d not in loc.where:
                    out.append(_finding("dependency", f"op {op.id} depends on op {d}, which does not exist", rank,
                                        section, i, op))
                elif d == op.id:
                    out.append(_finding("dependency", f"op {op.id} depends on itself", rank, section, i, op))
    if out:
        return out
    # Edges: explicit deps, and stream FIFO order between consecutive device ops.
    preds: dict[O.OpId, list[O.OpId]] = {op.id: list(O.op_deps(op)) for op in program.all_ops()}
    last_on_stream: dict[str, O.OpId] = {}
    for op in program.step:
        if O.is_device_op(op):
            prev = last_on_stream.get(op.stream)
            if prev is not None:
                preds[op.id].append(prev)
            last_on_stream[op.stream] = op.id
    cycle = _find_cycle(preds)
    if cycle:
        section, i, op = loc.where[cycle[0]]
        path = " -> ".join(str(c) for c in cycle + [cycle[0]])
        out.append(_finding("dependency", f"dependency cycle {path} (each waits on the next)", rank, section, i, op))
        return out
    for section, seq in (("setup", program.setup), ("step", program.step)):
        for i, op in enumerate(seq):
            for d in O.op_deps(op):
                if loc.order(d) > (0 if section == "setup" else 1, i):
                    dsec, di, _ = loc.where[d]
                    out.append(_finding(
                        "dependency",
                        f"waits on op {d}, issued later ({dsec} op {di}); a real run cannot wait on an op not yet issued",
                        rank, section, i, op,
                    ))
    return out


def _find_cycle(preds: dict[O.OpId, list[O.OpId]]) -> list[O.OpId]:
    """Kahn's algorithm; if nodes remain, walk predecessors among them to a repeat."""
    indeg = {n: 0 for n in preds}
    succs: dict[O.OpId, list[O.OpId]] = defaultdict(list)
    for n, ps in preds.items():
        for p in ps:
            succs[p].append(n)
            indeg[n] += 1
    ready = [n for n, d in indeg.items() if d == 0]
    seen = 0
    while ready:
        n = ready.pop()
        seen += 1
        for s in succs[n]:
            indeg[s] -= 1
            if indeg[s] == 0:
                ready.append(s)
    if seen == len(preds):
        return []
    left = {n for n, d in indeg.items() if d > 0}
    node = min(left)
    path: list[O.OpId] = []
    index: dict[O.OpId, int] = {}
    while node not in index:
        index[node] = len(path)
        path.append(node)
        node = next(p for p in preds[node] if p in left)
    return path[index[node]:]  # each waits on the next, the last on the first


def _check_buffers(program: Program, rank: int) -> list[Finding]:
    out: list[Finding] = []
    live: dict[str, int] = {}  # buffer -> size
    freed: set[str] = set()
    at_step_start: dict[str, int] = {}
    for section, seq in (("setup", program.setup), ("step", program.step)):
        if section == "step":
            at_step_start = dict(live)
        for i, op in enumerate(seq):
            if isinstance(op, O.Alloc):
                if op.buffer in live:
                    out.append(_finding("buffer", f"allocates {op.buffer!r} again while it is live", rank, section, i, op))
                live[op.buffer] = op.size_bytes
                freed.discard(op.buffer)
            elif isinstance(op, O.Free):
                if op.buffer in live:
                    del live[op.buffer]
                    freed.add(op.buffer)
                elif op.buffer in freed:
                    out.append(_finding("buffer", f"frees {op.buffer!r} twice", rank, section, i, op))
                else:
                    out.append(_finding("buffer", f"frees {op.buffer!r}, which was never allocated", rank, section, i, op))
            else:
                for b in O.op_buffers(op):
                    if b not in live:
                        what = "after it was freed" if b in freed else "before it is allocated"
                        out.append(_finding("buffer", f"uses {b!r} {what}", rank, section, i, op))
    # A step must leave memory as it found it, or every step would grow (or lose) state.
    for b in live:
        if b not in at_step_start:
            out.append(Finding("buffer", f"buffer {b!r} is allocated in the step and never freed (it would leak every step)", rank))
        elif live[b] != at_step_start[b]:
            out.append(Finding("buffer", f"buffer {b!r} ends the step with {live[b]} bytes, began it with {at_step_start[b]}", rank))
    for b in at_step_start:
        if b not in live:
            out.append(Finding("buffer", f"buffer {b!r}, live when the step begins, is freed and not re-allocated by its end", rank))
    return out


def _collective_signature(op: O.Collective) -> tuple:
    return (op.kind, op.size_bytes, op.dtype, op.reduce_op, op.root)


def _check_matching(schedule: Schedule) -> list[Finding]:
    # Per program: the collectives of each group, in issue order, with their step index.
    per_program: list[dict[tuple[int, ...], list[tuple[int, O.Collective]]]] = []
    for program in schedule.programs:
        groups: dict[tuple[int, ...], list[tuple[int, O.Collective]]] = defaultdict(list)
        for i, op in enumerate(program.step):
            if isinstance(op, O.Collective):
                groups[op.group].append((i, op))
        per_program.append(groups)
    all_groups = sorted({g for groups in per_program for g in groups})
    out: list[Finding] = []
    for group in all_groups:
        members = [r for r in group if 0 <= r < schedule.world_size]
        if not members:
            continue
        ref = members[0]
        ref_prog = schedule.rank_program[ref]
        ref_seq = per_program[ref_prog].get(group, [])
        for r in members[1:]:
            prog = schedule.rank_program[r]
            if prog == ref_prog:
                continue
            seq = per_program[prog].get(group, [])
            gname = ",".join(map(str, group))
            for pos, ((i, op), (ri, rop)) in enumerate(zip(seq, ref_seq)):
                if _collective_signature(op) != _collective_signature(rop):
                    out.append(Finding(
                        "collective order",
                        f"collective #{pos} of group ({gname}) differs from rank {ref}'s "
                        f"(step op {ri} `{op_to_text(rop)}`): a real run would hang or mix data; rank {r} issues",
                        r, "step", i, op_to_text(op),
                    ))
                    break
            else:
                if len(seq) != len(ref_seq):
                    longer, idx = (seq, r) if len(seq) > len(ref_seq) else (ref_seq, ref)
                    i, op = longer[min(len(seq), len(ref_seq))]
                    out.append(Finding(
                        "collective order",
                        f"rank {r} issues {len(seq)} collectives on group ({gname}), rank {ref} issues "
                        f"{len(ref_seq)}: the extra one would hang; rank {idx} issues",
                        idx, "step", i, op_to_text(op),
                    ))
    return out


def validate(schedule: Schedule) -> list[Finding]:
    """All problems found, most fundamental first (an empty list means valid)."""
    out: list[Finding] = []
    if schedule.world_size <= 0:
        return [Finding("structure", "world_size must be positive")]
    if len(schedule.rank_program) != schedule.world_size:
        return [Finding("structure", f"rank_program has {len(schedule.rank_program)} entries for world_size {schedule.world_size}")]
    ranks_of: dict[int, list[int]] = defaultdict(list)
    for r, p in enumerate(schedule.rank_program):
        ranks_of[p].append(r)
    for index, program in enumerate(schedule.programs):
        ranks = ranks_of.get(index)
        if not ranks:
            continue
        out.extend(_check_structure(program, ranks[0], schedule.world_size))
        out.extend(_check_membership(program, ranks))
        out.extend(_check_deps(program, ranks[0]))
        out.extend(_check_buffers(program, ranks[0]))
    if out:
        return out
    return _check_matching(schedule)


def check_valid(schedule: Schedule, source: str = "schedule") -> None:
    """Raise ScheduleInvalidError naming the first problem, in one line."""
    findings = validate(schedule)
    if findings:
        more = f" (and {len(findings) - 1} more)" if len(findings) > 1 else ""
        raise ScheduleInvalidError(f"{source}: {findings[0].line()}{more}")
