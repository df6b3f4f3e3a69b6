"""Running a schedule on every rank: under torchrun / srun, or K local processes.

``worker()`` is one rank: it joins the process group (with a short timeout so that a
dead peer turns into an error rather than a hang), runs the schedule, gathers every
rank's records to rank 0, which writes the measured trace atomically.

``launch_local()`` starts K ranks itself (spawned processes), watches them, and if one
dies or fails it stops all the others and reports which rank failed at which op: the
failing rank's own message when it could write one, else the op it was issuing (a
shared progress array every rank updates).

``execute()`` and ``calibrate()`` are what ``commsim execute`` and ``commsim calibrate``
run: as one rank of a job torchrun / srun started (the environment names the rank, its
node's ranks and the rendezvous: ``runtime.rendezvous``), or by starting the local ranks
themselves. On GPUs each rank drives one device: the only one it sees when the launcher
gave each task its own, else the one of its rank on the node.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from commsim.hardware.platform import platform_of_backend
from commsim.ir.errors import CommsimInputError
from commsim.ir.serialize import schedule_hash
from commsim.ir.text import op_to_text
from commsim.ir.trace import Trace, TraceMeta, TraceSource, make_trace


@dataclass(frozen=True)
class ExecConfig:
    schedule_path: str
    output: str
    backend: str = "gloo"
    steps: int = 3
    warmup: int = 1
    check_data: bool = False
    timeout_s: float = 60.0  # a collective waiting longer than this fails the run
    fail_rank: int = -1  # test hook: this rank exits abruptly ...
    fail_op: int = -1  # ... when it reaches this op id


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bind_device(backend: str, local_rank: int) -> None:
    """A GPU backend's rank drives one device (``rendezvous.cuda_device_index``)."""
    if _queues_on_gpu(backend):
        from runtime.rendezvous import cuda_device_index

        torch.cuda.set_device(cuda_device_index(local_rank, torch.cuda.device_count()))


def worker(cfg: ExecConfig, rank: int, world: int, local_rank: int, init: str | None,
           progress=None, err_dir: str | None = None, ranks_per_node: int | None = None,
           nodes: int = 1) -> None:
    from commsim.ir.load import load_schedule_any
    from runtime.executor import RankExecutor, RankOptions

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    # The host thread and the stream threads share the GIL: hand it over often, so a
    # stream is not kept waiting for Python's default 5 ms switch interval.
    sys.setswitchinterval(0.0002)
    try:
        schedule = load_schedule_any(cfg.schedule_path)
        _bind_device(cfg.backend, local_rank)
        dist.init_process_group(cfg.backend, init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=cfg.timeout_s))
        opts = RankOptions(steps=cfg.steps, warmup=cfg.warmup, check_data=cfg.check_data, progress=progress)
        if rank == cfg.fail_rank:
            _arm_failure(schedule, rank, cfg.fail_op, opts)
        ex = RankExecutor(schedule, rank, cfg.backend, opts)
        run = ex.run()
        gathered = [None] * world if rank == 0 else None
        dist.gather_object((run.records, run.step_times_ns, run.memory_stats, run.own_device_bytes,
                            run.step_starts_ns), gathered, dst=0)
        if rank == 0:
            records = [r for item in gathered for r in item[0]]  # type: ignore[union-attr]
            steps = {r: item[1] for r, item in enumerate(gathered)}  # type: ignore[arg-type]
            mem = gathered[0][2] if gathered else {}  # type: ignore[index]
            own = gathered[0][3] if gathered else 0  # type: ignore[index]
            per_step = [max(steps[r][i] for r in steps) for i in range(cfg.steps)]
            # each rank's records count from its own start of each step (after a barrier
            # whose exits differ by up to a few ms): its starts on the monotonic clock put
            # one node's ranks on one timeline (``Trace.on_one_clock``)
            starts = {str(r): item[4] for r, item in enumerate(gathered)}  # type: ignore[index]
            # rank 0's allocator figures, and how much of its device memory is the
            # executor's own (kernels' rings and scratch, collectives' partitions) rather
            # than the schedule's: what to subtract before comparing with a prediction
            meta = TraceMeta(TraceSource.MEASURED, producer=f"commsim execute ({cfg.backend})",
                             schedule_hash=schedule_hash(schedule), hardware=_machine(cfg.backend),
                             extra=(("step_times_ns", per_step), ("warmup_steps", cfg.warmup),
                                    ("memory_stats_rank0", mem), ("executor_own_device_bytes_rank0", own),
                                    ("world_size", world), ("ranks_per_node", ranks_per_node or world),
                                    ("nodes", nodes), ("step_start_monotonic_ns", starts)))
            make_trace(meta, records).save(cfg.output)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the launcher, then exit non-zero
        msg = str(e) if "rank " in str(e) else f"rank {rank}: {type(e).__name__}: {e}"
        if err_dir:
            Path(err_dir, f"rank{rank}.txt").write_text(msg + "\n" + traceback.format_exc())
        print(f"commsim execute: {msg}", file=sys.stderr)
        os._exit(1)


def _arm_failure(schedule, rank: int, op_id: int, opts) -> None:
    """Test hook: die (no message, like a crash) when reaching ``op_id``."""
    real = opts.progress

    class Tripwire:
        def __setitem__(self, r, v):
            if real is not None:
                real[r] = v
            if v == op_id:
                os._exit(17)

    opts.progress = Tripwire()


def _queues_on_gpu(backend: str) -> bool:
    """The backend's platform queues kernels on a GPU: each rank needs a device of its own."""
    return not platform_of_backend(backend).inline_kernels


def _machine(backend: str) -> str:
    if _queues_on_gpu(backend) and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} x{torch.cuda.device_count()}, torch {torch.__version__}"
    return f"{os.cpu_count()} CPU cores ({os.uname().machine}), torch {torch.__version__}, gloo"


def _spawned(cfg: ExecConfig, rank: int, world: int, port: int, progress, err_dir: str) -> None:
    worker(cfg, rank, world, rank, f"tcp://127.0.0.1:{port}", progress, err_dir, ranks_per_node=world)


# A free port is found by binding port 0 and closing it, and rank 0's store binds it a
# moment later: another process (a test suite's Ray workers, a second run) can take it
# in between. Rank 0 then fails at its rendezvous before any work, so the ranks are
# started again on another port.
PORT_ATTEMPTS = 3


def port_clash(message: str) -> bool:
    """Did a run fail because its rendezvous port was taken (before any work)?"""
    return "EADDRINUSE" in message or "address already in use" in message.lower()


def _on_a_free_port(run):
    for attempt in range(PORT_ATTEMPTS):
        try:
            return run(_free_port())
        except ExecutionFailed as e:
            if attempt + 1 == PORT_ATTEMPTS or not port_clash(str(e)):
                raise


def launch_local(cfg: ExecConfig, nproc: int, wall_timeout_s: float | None = None) -> Trace:
    """Run ``nproc`` local ranks; on any failure stop them all and raise ExecutionFailed."""
    return _on_a_free_port(lambda port: _launch_local_on(cfg, nproc, port, wall_timeout_s))


def _launch_local_on(cfg: ExecConfig, nproc: int, port: int, wall_timeout_s: float | None) -> Trace:
    from commsim.ir.load import load_schedule_any

    schedule = load_schedule_any(cfg.schedule_path)
    if schedule.world_size != nproc:
        raise CommsimInputError(f"{cfg.schedule_path}: the schedule has {schedule.world_size} ranks; "
                                f"--nproc-per-node {nproc} starts {nproc}")
    if _queues_on_gpu(cfg.backend) and torch.cuda.device_count() < nproc:
        raise CommsimInputError(f"--backend {cfg.backend}: {nproc} ranks need {nproc} GPUs, "
                                f"found {torch.cuda.device_count()}")
    ctx = mp.get_context("spawn")
    progress = ctx.Array("q", [-1] * nproc, lock=False)
    texts = {op.id: op_to_text(op) for r in range(nproc) for op in schedule.program_of(r).step}
    wall = wall_timeout_s or (cfg.timeout_s * 4 + 120)
    with tempfile.TemporaryDirectory(prefix="commsim-exec-") as err_dir:
        procs = [ctx.Process(target=_spawned, args=(cfg, r, nproc, port, progress, err_dir), daemon=True)
                 for r in range(nproc)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + wall
        failed: int | None = None
        try:
            while True:
                alive = [p for p in procs if p.exitcode is None]
                bad = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if bad:
                    failed = bad[0]
                    # the first rank that wrote its own error is the most informative
                    written = [r for r in bad if Path(err_dir, f"rank{r}.txt").exists()]
                    silent = [r for r in bad if r not in written]
                    failed = silent[0] if silent else written[0]
                    break
                if not alive:
                    break
                if time.monotonic() > deadline:
                    failed = -1
                    break
                time.sleep(0.05)
        finally:
            if failed is not None:
                time.sleep(0.2)
                for p in procs:
                    if p.exitcode is None:
                        p.terminate()
                for p in procs:
                    p.join(5)
                    if p.exitcode is None:
                        p.kill()
                        p.join()
        if failed is not None:
            if failed == -1:
                ops = ", ".join(f"rank {r} at `{texts.get(progress[r], progress[r])}`" for r in range(nproc))
                raise ExecutionFailed(f"{cfg.schedule_path}: no progress within {wall:.0f} s; stopped all ranks "
                                      f"({ops})")
            path = Path(err_dir, f"rank{failed}.txt")
            if path.exists():
                msg = path.read_text().splitlines()[0]
            else:
                op_id = progress[failed]
                msg = (f"rank {failed} died (exit code {procs[failed].exitcode}) while issuing op {op_id} "
                       f"`{texts.get(op_id, '?')}`")
            raise ExecutionFailed(f"{cfg.schedule_path}: {msg}; stopped all ranks")
    return Trace.load(cfg.output)


def _calibrate_rank(rank: int, world: int, port: int, backend: str, quick: bool, out: str, err_dir: str,
                    shapes: tuple = ()) -> None:
    import json

    from commsim.util.files import atomic_write_text
    from runtime.calibrate import Calibrator

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    sys.setswitchinterval(0.0002)  # as in worker(): measure the executor as it will run
    try:
        _bind_device(backend, rank)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))
        profile = Calibrator(rank, world, backend, quick=quick, log=lambda m: print(f"calibrate: {m}", flush=True),
                             shapes=shapes, ranks_per_node=world, nodes=1).run()
        if rank == 0:
            atomic_write_text(out, json.dumps(profile, indent=1))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001
        Path(err_dir, f"rank{rank}.txt").write_text(f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
        os._exit(1)


def calibrate_env(backend: str, out: str, quick: bool = False, shapes: tuple = ()) -> None:
    """Calibrate as one rank of a job started by torchrun / srun (or by hand, e.g. ranks in
    separate network namespaces): rank, world, ranks per node and rendezvous come from
    the environment (``runtime.rendezvous``); rank 0 writes the profile."""
    import json

    from commsim.util.files import atomic_write_text
    from runtime.calibrate import Calibrator
    from runtime.executor import env_rank

    env = env_rank()
    assert env is not None, "calibrate_env needs RANK / WORLD_SIZE or srun's SLURM_PROCID / SLURM_NTASKS"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    sys.setswitchinterval(0.0002)
    _bind_device(backend, env.local_rank)
    dist.init_process_group(backend, init_method=env.init_method, rank=env.rank, world_size=env.world,
                            timeout=datetime.timedelta(seconds=300))
    rank = env.rank
    try:
        # the ranks sharing a node (and so its links) come from the launcher; unknown
        # (RANK / WORLD_SIZE set by hand, no LOCAL_WORLD_SIZE): all ranks on one machine
        profile = Calibrator(rank, env.world, backend, quick=quick, log=lambda m: print(f"calibrate: {m}", flush=True),
                             shapes=shapes, ranks_per_node=env.ranks_per_node, nodes=env.nodes).run()
        if rank == 0:
            atomic_write_text(out, json.dumps(profile, indent=1))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def calibrate_local(nproc: int, backend: str, out: str, quick: bool = False, wall_timeout_s: float = 900,
                    shapes: tuple = ()) -> None:
    _on_a_free_port(lambda port: _calibrate_local_on(nproc, backend, out, quick, wall_timeout_s, shapes, port))


def _calibrate_local_on(nproc: int, backend: str, out: str, quick: bool, wall_timeout_s: float, shapes: tuple,
                        port: int) -> None:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="commsim-cal-") as err_dir:
        procs = [ctx.Process(target=_calibrate_rank, args=(r, nproc, port, backend, quick, out, err_dir, shapes), daemon=True)
                 for r in range(nproc)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + wall_timeout_s
        try:
            while any(p.exitcode is None for p in procs):
                bad = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if bad or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        finally:
            for p in procs:
                if p.exitcode is None:
                    p.terminate()
                p.join(5)
        bad = [r for r, p in enumerate(procs) if p.exitcode != 0]
        if bad:
            path = Path(err_dir, f"rank{bad[0]}.txt")
            msg = path.read_text().splitlines()[0] if path.exists() else f"rank {bad[0]} did not finish"
            raise ExecutionFailed(f"calibrate: {msg}")


class ExecutionFailed(RuntimeError):
    """The run ended because a rank died or failed (message names the rank and op)."""


def execute(cfg: ExecConfig, nproc: int | None = None) -> Trace | None:
    """Run a schedule (``cfg``) and return the measured trace rank 0 wrote: as one rank of
    a job torchrun / srun started (None on the other ranks), or as ``nproc`` local ranks
    (default: the schedule's size)."""
    from commsim.ir.load import load_schedule_any
    from commsim.ir.validate import check_valid
    from runtime.executor import env_rank

    schedule = load_schedule_any(cfg.schedule_path)
    check_valid(schedule, cfg.schedule_path)
    env = env_rank()
    if env is None:
        return launch_local(cfg, nproc or schedule.world_size)
    if env.world != schedule.world_size:
        raise CommsimInputError(f"{cfg.schedule_path}: the schedule has {schedule.world_size} ranks, the launcher "
                                f"started {env.world}")
    worker(cfg, env.rank, env.world, env.local_rank, env.init_method, ranks_per_node=env.ranks_per_node,
           nodes=env.nodes)
    return Trace.load(cfg.output) if env.rank == 0 else None


def gemm_shapes(paths: list[str]) -> tuple[tuple[str, int, int, int, int], ...]:
    """(dtype, m, n, k, batch) of every GEMM / attention matmul in these schedule files,
    in each one's precision (what ``calibrate --schedule`` times)."""
    from commsim.ir import ops as O
    from commsim.ir.load import load_schedule_any

    out: dict[tuple, None] = {}
    for path in paths:
        schedule = load_schedule_any(path)
        dtype = schedule.meta.precision or "fp32"  # the loader checked it is one of PRECISIONS
        for program in schedule.programs:
            for op in program.step:
                if isinstance(op, O.Compute) and op.gemm is not None:
                    out[(dtype, op.gemm.m, op.gemm.n, op.gemm.k, op.gemm.batch)] = None
    return tuple(out)


@dataclass(frozen=True)
class Calibrated:
    """Where a calibration ran: its ranks, whether the environment started them, and
    whether this process wrote the profile (rank 0)."""

    ranks: int
    from_env: bool
    wrote: bool


def calibrate(out: str, backend: str = "gloo", nproc: int = 2, quick: bool = False, schedules: tuple[str, ...] = (),
              deepspeed_host_costs: bool = False, fsdp2_host_costs: bool = False, fsdp1_host_costs: bool = False,
              log=None) -> Calibrated:
    """Measure this machine into the hardware profile ``out``: as one rank of a job
    torchrun / srun started, or as ``nproc`` local ranks; ``schedules``' GEMM shapes are
    timed too; ``deepspeed_host_costs`` / ``fsdp2_host_costs`` / ``fsdp1_host_costs``
    (local ranks only) add real DeepSpeed's / FSDP2's / FSDP1's hook costs to the profile."""
    import json

    from runtime.executor import env_rank

    shapes = gemm_shapes(list(schedules))
    found = env_rank()
    if found is not None:  # one rank of a job someone else launched (torchrun, srun)
        for flag, on in (("--deepspeed-host-costs", deepspeed_host_costs), ("--fsdp2-host-costs", fsdp2_host_costs),
                         ("--fsdp1-host-costs", fsdp1_host_costs)):
            if on:
                raise CommsimInputError(f"{flag}: run it without torchrun (it launches its own processes)")
        calibrate_env(backend, out, quick=quick, shapes=shapes)
        return Calibrated(found.world, True, found.rank == 0)
    calibrate_local(nproc, backend, out, quick=quick, shapes=shapes)
    measured = []
    if deepspeed_host_costs:
        from runtime.calibrate_ds import measure_host_costs

        measured.append(measure_host_costs(nproc, out, log=log or (lambda m: None)))
    if fsdp2_host_costs:
        from runtime.fsdp2_host_costs import measure_for_profile

        measured.append(measure_for_profile(log=log or (lambda m: None)))
    if fsdp1_host_costs:
        from runtime.fsdp1_host_costs import measure_for_profile as measure_fsdp1

        measured.append(measure_fsdp1(log=log or (lambda m: None)))
    if measured:
        from commsim.util.files import atomic_write_text
        from runtime.calibrate_ds import merge_host_costs

        profile = json.loads(Path(out).read_text())
        for costs in measured:
            profile["host_costs"] = merge_host_costs(profile.get("host_costs"), costs)
        atomic_write_text(out, json.dumps(profile, indent=1))
    return Calibrated(nproc, False, True)
