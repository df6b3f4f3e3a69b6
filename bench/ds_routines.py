"""Where a real DeepSpeed or FSDP2 step's host time goes, routine by routine, timed inside the step.

    python bench/ds_routines.py --row 'DS small-gpt2 z3 small buckets'
    python bench/ds_routines.py --row 'DS small z3' --profile PROFILE.json   # and the prediction's host ops
    python bench/ds_routines.py --row 'FSDP2 small'

Runs one DeepSpeed or FSDP2 row of the local grid (``bench/local_grid.py``) as
bench/validate_local.py does (``runtime.examples.ds_train`` or ``fsdp_train`` under torchrun,
gloo, ``DS_ACCELERATOR=cpu``, one thread a rank), with the framework's routines wrapped by
timers: DeepSpeed's ZeRO routines (module hooks, parameter fetch and release, gradient
hooks, bucket flushes, the epilogue, the optimizer step's parts) and the CPU accelerator's
``device_count``; or FSDP2's (its units' pre/post forward and backward hooks, the root's
pre-forward and final callback, unshard and its wait, reshard, the batched all-gather, its
copy-out and the reduce), and in both the c10d calls: each call's wall time, the calling
thread's CPU time and its minor faults. FSDP2's phases are the root module's call, the
loss's ``backward`` and ``AdamW.step``. No profiler: a Kineto trace on CPUs charges its own cost to
the ops that allocate. Beside it, the same model runs plain (no DeepSpeed, the same
checkpointing, micro-batch and sequence; as many processes as ranks, at once, so each has the
core share a rank has) and its forward and backward are timed the same way.

It prints, for rank 0 over the steps after the warm-up: each phase's wall and thread time a
step against the plain model's (what DeepSpeed adds to the thread), each routine's thread
and wall time and calls a step (inclusive: a routine's time holds the routines it calls),
and, for the routines called at the same sites every step, the sum over sites of each site's
minimum, median and mean over steps (calibrate times a routine as its minimum over steps;
a step pays its mean). Every module call is timed too, in both runs (``torch.nn.Module``'s
``__call__``): per module class the exclusive thread time a step (hooks included, children
left out) and what the framework adds a call. With ``--profile``, the row's prediction from that
profile: the host ops a step by phase and kind, to set beside the measured routines.
Figures from this machine are in ``traces/README.md`` ("DeepSpeed's routines inside a
real step", "FSDP2's routines inside a real step").
"""

from __future__ import annotations

import argparse
import bisect
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from local_grid import GRID, Row, row_config  # noqa: E402
from local_report import DEEPSPEED_WARMUP, FSDP2_WARMUP, framework_warmup  # noqa: E402

S3 = ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3")
PPC = ("deepspeed.runtime.zero.partitioned_param_coordinator", "PartitionedParameterCoordinator")
OFF = ("deepspeed.runtime.zero.parameter_offload", "DeepSpeedZeRoOffload")
ENG = ("deepspeed.runtime.engine", "DeepSpeedEngine")
# (module, class or None, attribute, label): what is timed. The engine's forward, backward
# and step are the phases (ds_train's own phase timer brackets the same calls).
ROUTINES = [
    (*ENG, "forward", "engine.forward"), (*ENG, "backward", "engine.backward"), (*ENG, "step", "engine.step"),
    (*OFF, "pre_sub_module_forward_function", "module pre-forward"),
    (*OFF, "post_sub_module_forward_function", "module post-forward"),
    (*OFF, "pre_sub_module_backward_function", "module pre-backward"),
    (*OFF, "post_sub_module_backward_function", "module post-backward"),
    (*PPC, "fetch_sub_module", "fetch"), (*PPC, "release_sub_module", "release"),
    (*PPC, "_PartitionedParameterCoordinator__all_gather_params", "gather params"),
    (*S3, "reduce_independent_p_g_buckets_and_remove_grads", "gradient hook"),
    (*S3, "_DeepSpeedZeroOptimizer_Stage3__add_grad_to_ipg_bucket", "add to bucket"),
    (*S3, "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads", "bucket flush"),
    (*S3, "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads", "flush: average and scatter"),
    (*S3, "partition_grads", "flush: partition grads"),
    (*S3, "independent_gradient_partition_epilogue", "epilogue"),
    (*S3, "_get_norm_groups", "step: norms"), (*S3, "_prepare_sub_group", "step: prepare sub-group"),
    (*S3, "unscale_and_clip_grads", "step: unscale and clip"), (*S3, "_optimizer_step", "step: optimizer"),
    (*S3, "_reassign_or_swap_out_partitioned_parameters", "step: reassign"),
    (*S3, "_post_step", "step: post-step"),
    ("deepspeed.accelerator.cpu_accelerator", "CPU_Accelerator", "device_count", "cpu accelerator device_count"),
]
C10D = [
    ("torch.distributed", None, "all_gather_into_tensor", "c10d all_gather_into_tensor"),
    ("torch.distributed", None, "reduce_scatter_tensor", "c10d reduce_scatter_tensor"),
    ("torch.distributed", None, "all_reduce", "c10d all_reduce"),
    # what FSDP2 calls in torch 2.13 (older releases: the two above)
    ("torch.distributed", None, "all_gather_single", "c10d all_gather_single"),
    ("torch.distributed", None, "reduce_scatter_single", "c10d reduce_scatter_single"),
]
_FS = "torch.distributed.fsdp._fully_shard."
PG = (_FS + "_fsdp_param_group", "FSDPParamGroup")
ST = (_FS + "_fsdp_state", "FSDPState")
# FSDP2 (torch 2.x's fully_shard): a unit's hooks (FSDPState) and its parameter group's
# work (FSDPParamGroup); the collectives' helpers as _fsdp_param_group imported them.
FSDP2_ROUTINES = [
    (*ST, "_root_pre_forward", "root pre-forward"), (*ST, "_pre_forward", "unit pre-forward"),
    (*ST, "_post_forward", "unit post-forward"), (*ST, "_pre_backward", "unit pre-backward"),
    (*ST, "_root_post_backward_final_callback", "root final callback"),
    (*PG, "unshard", "unshard"), (*PG, "wait_for_unshard", "wait for unshard"), (*PG, "reshard", "reshard"),
    (*PG, "post_backward", "unit post-backward"),
    (PG[0], None, "foreach_all_gather", "foreach_all_gather"),
    (PG[0], None, "foreach_all_gather_copy_out", "all-gather copy-out"),
    (PG[0], None, "foreach_reduce", "foreach_reduce"),
    (_FS + "_fsdp_collectives", None, "foreach_reduce_scatter_copy_in", "reduce: copy-in"),
    (_FS + "_fsdp_collectives", None, "_div_if_needed", "reduce: divide"),
]
PHASES = {"engine.forward": "forward", "engine.backward": "backward", "engine.step": "step"}
FRAMEWORK = {"deepspeed": "DeepSpeed", "fsdp2": "FSDP2"}
PAGE_BYTES = 4096  # a minor fault maps one base page


# ------------------------------------------------------------------ what the report reads


def phase_spans(events: list) -> dict[str, list]:
    """Each phase's calls (label, t0, t1, thread_s, faults), in time order."""
    return {ph: sorted((e for e in events if e[0] == lab), key=lambda e: e[1]) for lab, ph in PHASES.items()}


def routine_table(events: list, first: int) -> dict[str, dict[str, tuple[float, float, float, float]]]:
    """Per phase, per routine: (thread ms, wall ms, calls, MiB of minor faults) a step,
    means over the phase's calls from the ``first``-th on; a routine counts in the phase
    whose span holds it."""
    out = {}
    for ph, spans in phase_spans(events).items():
        spans = spans[first:]
        if not spans:
            continue
        starts = [s[1] for s in spans]
        acc: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
        for e in events:
            i = bisect.bisect_right(starts, e[1]) - 1
            if i >= 0 and e[2] <= spans[i][2]:
                a = acc[e[0]]
                a[0] += e[3] * 1e3
                a[1] += (e[2] - e[1]) * 1e3
                a[2] += 1
                a[3] += e[4] * PAGE_BYTES / 2**20
        out[ph] = {k: (v[0] / len(spans), v[1] / len(spans), v[2] / len(spans), v[3] / len(spans))
                   for k, v in acc.items()}
    return out


def site_sums(events: list, label: str, first: int) -> tuple[float, float, float] | None:
    """A routine called at the same sites every step (the k-th call of step i and of step
    j are one site): the sum over sites of each site's minimum, median and mean thread
    time over the steps from the ``first``-th on, ms. None when the steps' counts differ."""
    steps = phase_spans(events)["forward"][first:]
    if len(steps) < 2:
        return None
    starts = [s[1] for s in steps] + [float("inf")]
    per: dict[int, list[float]] = defaultdict(list)
    for e in sorted((e for e in events if e[0] == label), key=lambda e: e[1]):
        i = bisect.bisect_right(starts, e[1]) - 1
        if i >= 0:
            per[i].append(e[3] * 1e3)
    counts = {len(per[i]) for i in range(len(steps))}
    if len(counts) != 1 or 0 in counts:
        return None
    sites = list(zip(*(per[i] for i in range(len(steps)))))
    return (sum(min(s) for s in sites), sum(statistics.median(s) for s in sites),
            sum(statistics.fmean(s) for s in sites))


# ------------------------------------------------------------------ the processes


def _wrap(events: list, module: str, cls: str | None, attr: str, label: str) -> None:
    import importlib
    import resource
    import time

    owner = importlib.import_module(module)
    if cls is not None:
        owner = getattr(owner, cls)
    f = getattr(owner, attr, None)
    if f is None:  # a routine this release does not have
        return

    @functools.wraps(f)
    def timed(*a, **k):
        m0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        c0, t0 = time.thread_time(), time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            t1, c1 = time.perf_counter(), time.thread_time()
            events.append((label, t0, t1, c1 - c0, resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - m0))

    setattr(owner, attr, timed)


def _time_modules(modules: dict) -> None:
    """Every module call's exclusive thread time (its own, hooks included, less its
    children's), summed per (step, class) into ``modules``. A step begins at each call
    of the first class called (the root: DeepSpeed's engine, or the plain model);
    recompute's calls count in the step whose backward runs them."""
    import time

    import torch

    call, stack, root, step = torch.nn.Module.__call__, [], [], [-1]

    def timed(self, *a, **k):
        cls = type(self).__name__
        if not root:
            root.append(cls)
        if cls == root[0] and not stack:
            step[0] += 1
        t0 = time.thread_time()
        stack.append(0.0)
        try:
            return call(self, *a, **k)
        finally:
            dt = time.thread_time() - t0
            children = stack.pop()
            if stack:
                stack[-1] += dt
            acc = modules.setdefault(f"{step[0]} {cls}", [0.0, 0])
            acc[0] += dt - children
            acc[1] += 1

    torch.nn.Module.__call__ = timed


def module_table(modules: dict, first: int) -> dict[str, tuple[float, float]]:
    """Per module class: (exclusive thread ms, calls) a step, means over steps ``first``
    on (the steps a run recorded)."""
    steps = {int(k.split(" ", 1)[0]) for k in modules}
    kept = [s for s in steps if s >= first]
    out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for k, (t, n) in modules.items():
        s, cls = k.split(" ", 1)
        if int(s) >= first:
            out[cls][0] += t * 1e3 / len(kept)
            out[cls][1] += n / len(kept)
    return {k: (v[0], v[1]) for k, v in out.items()}


def worker(out: Path, runner: str, train_args: list[str]) -> None:
    """One rank: ds_train or fsdp_train with the routines wrapped; its events to
    ``out``/rank<r>.json."""
    import atexit
    import runpy

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    events: list = []
    modules: dict = {}
    for spec in (ROUTINES if runner == "deepspeed" else FSDP2_ROUTINES) + C10D:
        _wrap(events, *spec)
    _time_modules(modules)
    if runner == "fsdp2":
        _fsdp2_phases(events)
    rank = os.environ.get("RANK", "0")
    atexit.register(lambda: (out / f"rank{rank}.json").write_text(json.dumps(events)))
    atexit.register(lambda: (out / f"rank{rank}.modules.json").write_text(json.dumps(modules)))
    script = "ds_train" if runner == "deepspeed" else "fsdp_train"
    sys.argv = [script, *train_args]
    runpy.run_module(f"runtime.examples.{script}", run_name="__main__")


def _fsdp2_phases(events: list) -> None:
    """fsdp_train's phases as the events DeepSpeed's engine gives: the root module's call
    (its FSDP2 hooks included), the loss's backward, the optimizer's step."""
    import runtime.torch_models as tm

    _wrap(events, "torch", "Tensor", "backward", "engine.backward")
    _wrap(events, "torch.optim", "AdamW", "step", "engine.step")
    build = tm.build_model

    def build_timed(*a, **k):
        m = build(*a, **k)
        # the root's class gets a timed __call__ of its own (the module timer's inside);
        # fully_shard's subclass of it inherits it, FSDP2's root hooks run inside it
        _wrap(events, type(m).__module__, type(m).__name__, "__call__", "engine.forward")
        return m

    tm.build_model = build_timed


def plain(out: Path, model: str, micro: int, seq: int, steps: int) -> None:
    """The row's model without DeepSpeed: forward and backward timed, one thread."""
    import time

    import torch

    from commsim.models import resolve_model
    from runtime.torch_models import build_model

    torch.set_num_threads(1)
    torch.manual_seed(0)
    modules: dict = {}
    _time_modules(modules)
    cfg = resolve_model(model)
    m = build_model(cfg)
    m.gradient_checkpointing_enable(use_reentrant=True)  # ds_train's default
    m.train()
    g = torch.Generator().manual_seed(1234)
    events = []
    for _ in range(steps):
        ids = torch.randint(0, cfg.vocab, (micro, seq), generator=g)
        c0, t0 = time.thread_time(), time.perf_counter()
        loss = m(ids, labels=ids)
        c1, t1 = time.thread_time(), time.perf_counter()
        loss.backward()
        c2, t2 = time.thread_time(), time.perf_counter()
        m.zero_grad(set_to_none=True)
        events += [("engine.forward", t0, t1, c1 - c0, 0), ("engine.backward", t1, t2, c2 - c1, 0)]
    out.write_text(json.dumps(events))
    out.with_suffix(".modules.json").write_text(json.dumps(modules))


def framework_row(name: str) -> Row:
    row = next((r for r in GRID if r.name == name), None)
    if row is None or row.runner not in FRAMEWORK:
        rows = [r.name for r in GRID if r.runner in FRAMEWORK]
        raise ValueError(f"--row {name!r}: not a DeepSpeed or FSDP2 row of the grid; rows: {', '.join(rows)}")
    return row


def run_row(row: Row, work: Path, steps: int) -> tuple[list, list, dict, dict]:
    """The row for real (wrapped) and its model plain: rank 0's events and plain run 0's,
    and their module times."""
    cfg = work / "ds.json"
    cfg.write_text(json.dumps(row_config(row)))
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               TORCH_EXTENSIONS_DIR=str(ROOT / ".cache" / "torch_extensions"))
    if row.runner == "deepspeed":
        train = ["--ds-config", str(cfg)]
    else:  # as bench/validate_local.py runs an FSDP2 row
        train = ["--micro-batch", str(row.micro), "--fsdp-config", str(cfg)]
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                    str(row.ranks), str(Path(__file__).resolve()), "--worker", str(work), row.runner, "--",
                    "--model", row.model, "--seq", str(row.seq), *train, "--steps", str(steps)],
                   cwd=ROOT, env=env, check=True, capture_output=True)
    procs = [subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--plain", str(work / f"plain{i}.json"),
                               row.model, str(row.micro), str(row.seq), str(steps)], cwd=ROOT, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
             for i in range(row.ranks)]
    for p in procs:
        if p.wait() != 0:
            raise RuntimeError(f"the plain model failed: {p.stderr.read().decode()[-2000:]}")
    read = lambda name: json.loads((work / name).read_text())  # noqa: E731
    return read("rank0.json"), read("plain0.json"), read("rank0.modules.json"), read("plain0.modules.json")


def predicted_host(row: Row, cfg: Path, profile: str) -> dict[str, dict[str, tuple[float, int]]]:
    """The row's prediction from ``profile``: rank 0's host ops a step, per phase (the
    measured phases' names; recompute counts in backward) and kind: (ms, ops)."""
    from dataclasses import replace

    from local_grid import scenario

    from commsim.api import predict

    trace = predict(replace(scenario(row, str(cfg), runner="framework"), hw_profile=profile)).trace()
    names = {"fwd": "forward", "bwd": "backward", "recompute": "backward", "optimizer": "step"}
    out: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
    for r in trace.records:
        if r.rank == 0 and r.stream == "host" and r.phase in names:
            a = out[names[r.phase]][r.kind]
            a[0] += r.duration_ns / 1e6
            a[1] += 1
    return {ph: {k: (v[0], v[1]) for k, v in kinds.items()} for ph, kinds in out.items()}


def report(row: Row, events: list, plain_events: list, first: int, predicted: dict | None,
           modules: dict | None = None, plain_modules: dict | None = None) -> list[str]:
    table = routine_table(events, first)
    plain_tab = routine_table(plain_events, first)
    fw = FRAMEWORK[row.runner]
    lines = [f"{row.name}: {row.ranks} ranks, rank 0, steps after the first {first}",
             f"{'phase':<10}{'wall ms':>10}{'thread ms':>11}{'plain thread ms':>17}{fw + ' adds':>16}"]
    for lab, ph in PHASES.items():
        if ph not in table:
            continue
        thread, wall = table[ph][lab][:2]
        p = plain_tab.get(ph, {}).get(lab)
        lines.append(f"{ph:<10}{wall:>10.1f}{thread:>11.1f}" + (f"{p[0]:>17.1f}{thread - p[0]:>+16.1f}" if p else ""))
    lines.append("routines, a step: thread ms (wall ms), calls, MiB of fresh pages (minor faults); inclusive of "
                 "the routines they call")
    for ph, routines in table.items():
        lines.append(f"  {ph}")
        for lab, (thread, wall, calls, mib) in sorted(routines.items(), key=lambda kv: -kv[1][0]):
            if lab not in PHASES:
                lines.append(f"    {lab:<32}{thread:>9.2f} ({wall:>8.2f}){calls:>8.1f}{mib:>9.1f}")
    lines.append("the same sites every step, thread ms a step: sum of each site's min / median / mean over steps")
    for lab in sorted({e[0] for e in events} - set(PHASES)):
        s = site_sums(events, lab, first)
        if s is not None:
            lines.append(f"  {lab:<32}{s[0]:>8.2f} /{s[1]:>8.2f} /{s[2]:>8.2f}  (mean / min {s[2] / s[0]:.2f})"
                         if s[0] > 0 else f"  {lab:<32}{s[0]:>8.2f} /{s[1]:>8.2f} /{s[2]:>8.2f}")
    if modules is not None and plain_modules is not None:
        mine, plain_mods = module_table(modules, first), module_table(plain_modules, first)
        lines.append(f"module calls (forward and recompute), exclusive thread ms a step (hooks included): {fw} / "
                     f"plain, calls, what {fw} adds a call")
        for cls, (t, n) in sorted(mine.items(), key=lambda kv: -(kv[1][0] - plain_mods.get(kv[0], (0.0, 0))[0])):
            p = plain_mods.get(cls)
            lines.append(f"  {cls:<32}{t:>9.2f} /" + (f"{p[0]:>9.2f}{n:>8.1f}{1e3 * (t - p[0]) / n:>+10.0f} us"
                                                       if p else f"{'':>9}{n:>8.1f}"))
    if predicted is not None:
        lines.append("predicted host ops a step (rank 0): ms, ops, per phase and kind")
        for ph in ("forward", "backward", "step"):
            kinds = predicted.get(ph, {})
            lines.append(f"  {ph:<10}" + ", ".join(f"{k} {ms:.2f} ({n})" for k, (ms, n)
                                                     in sorted(kinds.items(), key=lambda kv: -kv[1][0]) if ms > 0))
    return lines


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":  # a rank, under torchrun
        worker(Path(sys.argv[2]), sys.argv[3], sys.argv[5:])
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--plain":
        out, model, micro, seq, steps = sys.argv[2:7]
        plain(Path(out), model, int(micro), int(seq), int(steps))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--row", required=True, help="a DeepSpeed or FSDP2 row of bench/local_grid.py")
    ap.add_argument("--steps", type=int, default=5, help="measured steps, after the grid's warm-up steps for the "
                    f"row's framework (DeepSpeed {DEEPSPEED_WARMUP}, FSDP2 {FSDP2_WARMUP}) (default 5)")
    ap.add_argument("--profile", help="a calibrated profile (commsim calibrate): print the row's predicted host ops")
    args = ap.parse_args()
    if args.steps < 2:
        ap.error("--steps: at least 2 (a site's spread over steps needs two)")
    try:
        row = framework_row(args.row)
    except ValueError as e:
        ap.error(str(e))
    if args.profile and not Path(args.profile).is_file():
        ap.error(f"--profile {args.profile}: no such file")
    work = Path(tempfile.mkdtemp(prefix="commsim-ds-routines-"))
    first = framework_warmup(row)
    events, plain_events, modules, plain_modules = run_row(row, work, args.steps + first)
    predicted = predicted_host(row, work / "ds.json", args.profile) if args.profile else None
    print("\n".join(report(row, events, plain_events, first, predicted, modules, plain_modules)))
    print(f"(events in {work})")


if __name__ == "__main__":
    main()
