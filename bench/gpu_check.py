"""commsim's GPU path on one GPU, in one command: does it run, and how close are its predictions?

    python bench/gpu_check.py [--timeout 450] [--keep DIR]

On a machine with a CUDA GPU, in under 8 minutes, it:

1. generates a schedule with commsim's own generator: DeepSpeed ZeRO-3 (bf16, layer-wise
   checkpointing) of a Llama-2-7B-shaped model trimmed to 4 layers (a Hugging Face
   config.json: hidden 4096, FFN 11008, 32 heads, vocab 32000), micro-batch 4 x 1024
   tokens, at world size 1: GEMMs of 4096 x 4096 x 11008, large enough for a GPU;
2. calibrates the GPU (``commsim calibrate --backend nccl --nproc-per-node 1``, timing the
   schedule's own GEMM shapes too);
3. executes the schedule (``commsim execute --backend nccl``, 2 warm-up and 5 measured
   steps) and, separately, the tiny model's schedule with ``--check-data``;
4. predicts the schedule from that profile, and from the preset of the GPU it found
   (A100 40/80 GB: p4d / dgx-a100; H100: p5; H200: p5's node with H200s; any other
   GPU: none);
5. compares each prediction with the measurement per op (by op kind: the median error
   and the 90th percentile of the absolute error) and for the step, and compares the
   simulated caching allocator's peak reserved memory and retries with
   ``torch.cuda.memory_stats`` of the run (less the memory the executor holds beyond
   the schedule's buffers);
6. times the host's round trips that old DeepSpeed's synchronising code is made of (a
   small kernel then ``.item()``, a pageable ``torch.ones(1).to("cuda")``, a synchronize
   of an idle device, a small op's launch) beside the constants commsim prices them with
   (``gpu_kernels.SMALL_COPY_LATENCY_NS``, the p4d A100's ``kernel_overhead_ns``, the
   launch in ``knobs.HOST_COSTS``);
7. times DeepSpeed 0.19.8's ZeRO-3 routines on this host's CPU as commsim's host-cost table
   was timed (``runtime.ds_host_costs``, device calls as no-ops, 8 ranks, with
   ``DS_ACCELERATOR=cpu`` and no visible GPU so that the code path is the table's) and
   prints each routine's time over the table's: their median is how many times as long
   this host takes for a host routine, the ``--host-scale`` that prices it (the table's
   core is taken as the p4d's, ``ds_host_costs.CPU_SCALE``). It needs DeepSpeed 0.19.8
   installed (requirements-test.txt);
8. reads the device's memory as CUDA reports it (total, and what this process's CUDA
   context holds after the round trips' small ops) beside the capacity commsim's preset
   gives the simulated caching allocator (``GpuSpec.hbm_bytes``, the datasheet's GB as
   10^9 bytes), which leaves the context and NCCL's buffers unmodelled.

It prints one summary line per check (``name: ...``) and exits 0 when every check ran,
1 when one failed or the time ran out (``--timeout`` seconds for all of them), 2
without a GPU (one line, nothing run). ``--cpu`` rehearses the same steps on this
machine's CPU with gloo and the tiny model (``calibrate --quick``): the figures mean
nothing, the script's own code runs (the test suite does this).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Llama-2-7B's shape (meta-llama/Llama-2-7b-hf config.json) with 4 of its 32 layers:
# about 1.07 B parameters, 17 GB of ZeRO-3 state at world size 1 (fits a 40 GB A100).
LLAMA_4L = {"model_type": "llama", "_name_or_path": "llama2-7b-4-layers", "hidden_size": 4096,
            "intermediate_size": 11008, "num_attention_heads": 32, "num_key_value_heads": 32,
            "num_hidden_layers": 4, "vocab_size": 32000, "max_position_embeddings": 4096,
            "tie_word_embeddings": False}
GPU_RUN = {"micro_batch": 4, "seq": 1024, "steps": 5, "warmup": 2}
CPU_RUN = {"micro_batch": 2, "seq": 16, "steps": 2, "warmup": 1}
DEVICE_OPS = ("gemm", "attention", "elementwise", "optimizer", "embedding", "all_gather", "reduce_scatter",
              "all_reduce", "broadcast", "copy_h2d", "copy_d2h", "copy_d2d")


class CheckFailed(Exception):
    """A check could not run: its one-line reason."""


class OutOfTime(Exception):
    """--timeout ran out during a check."""


def no_gpu() -> str | None:
    """Why this machine cannot run the check, or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed (pip install 'commsim[runtime]' with a CUDA build of torch)"
    if not torch.cuda.is_available():
        return f"no CUDA GPU visible (torch {torch.__version__}, torch.cuda.is_available() is False); run it where one is"
    return None


class Runner:
    """Runs commsim commands within one deadline for all checks."""

    def __init__(self, timeout_s: float):
        self.deadline = time.monotonic() + timeout_s
        self.timeout_s = timeout_s

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def commsim(self, *args: str) -> str:
        if self.left() <= 1:
            raise OutOfTime()
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        try:
            out = subprocess.run([sys.executable, "-m", "commsim.cli", *args], capture_output=True, text=True,
                                 cwd=ROOT, env=env, timeout=self.left())
        except subprocess.TimeoutExpired:
            raise OutOfTime() from None
        if out.returncode != 0:
            lines = [ln for ln in out.stderr.strip().splitlines() if ln.strip()] or [f"exit status {out.returncode}"]
            raise CheckFailed(f"commsim {args[0]} exited {out.returncode}: {lines[-1].strip()}")
        return out.stdout


# ---------------------------------------------------------------- comparisons
def op_durations(trace, rank: int = 0) -> dict[int, tuple[str, float]]:
    """op id -> (kind, median duration in ns over the trace's steps) of ``rank``'s device ops."""
    from commsim.ir.trace import HOST_STREAM

    by: dict[int, tuple[str, list[int]]] = {}
    for r in trace.records:
        if r.rank == rank and r.stream != HOST_STREAM:
            by.setdefault(r.op_id, (r.kind, []))[1].append(r.end_ns - r.start_ns)
    return {op: (kind, statistics.median(ds)) for op, (kind, ds) in by.items()}


def per_kind_errors(predicted, measured) -> dict[str, list[float]]:
    """Kind -> each op's (predicted - measured) / measured, for the ops both have (ops
    measured at 0 ns, below the clock, are left out)."""
    pred, meas = op_durations(predicted), op_durations(measured)
    out: dict[str, list[float]] = {}
    for op, (kind, m) in meas.items():
        if op in pred and m > 0:
            out.setdefault(kind, []).append((pred[op][1] - m) / m)
    return out


def p90(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, math.ceil(0.9 * len(s)) - 1)]


def error_line(errors: dict[str, list[float]]) -> str:
    order = {k: i for i, k in enumerate(DEVICE_OPS)}
    parts = [f"{kind} {statistics.median(e):+.0%} / {p90([abs(x) for x in e]):.0%} (n={len(e)})"
             for kind, e in sorted(errors.items(), key=lambda kv: (order.get(kv[0], 99), kv[0]))]
    return "; ".join(parts) + "  [kind median error / p90 |error| (ops)]" if parts else "no op in common"


def rel(a: float, b: float) -> str:
    return f"{(a - b) / b:+.1%}" if b else "n/a"


# ---------------------------------------------------------------- host round trips
def round_trips_us(torch, repeats: int = 200) -> dict[str, float]:
    """Median microseconds, on the current CUDA device, of: a one-element kernel then
    ``.item()`` (launch, kernel, device-to-host copy, the host's wait); a pageable
    ``torch.ones(1).to("cuda")`` (PyTorch waits for a blocking copy); a synchronize of an
    idle device; and the host time of one small op's launch, from ``repeats`` launched
    back to back."""
    x = torch.zeros(1, device="cuda")
    torch.cuda.synchronize()

    def median_us(fn) -> float:
        times = []
        for _ in range(repeats):
            t = time.perf_counter_ns()
            fn()
            times.append(time.perf_counter_ns() - t)
        return statistics.median(times) / 1e3

    out = {"kernel_then_item": median_us(lambda: x.add_(1).item()),
           "pageable_h2d": median_us(lambda: torch.ones(1).to("cuda")),
           "idle_synchronize": median_us(torch.cuda.synchronize)}
    t = time.perf_counter_ns()
    for _ in range(repeats):
        x.add_(1)
    out["launch"] = (time.perf_counter_ns() - t) / repeats / 1e3
    torch.cuda.synchronize()
    return out


def round_trip_line(us: dict[str, float], device: str) -> str:
    """The round trips beside the constants commsim prices them with."""
    from commsim.hardware.gpu_kernels import SMALL_COPY_LATENCY_NS
    from commsim.hardware.specs import NODE_PRESETS
    from commsim.strategies.knobs import host_costs_for

    copy, kern = SMALL_COPY_LATENCY_NS / 1e3, NODE_PRESETS["p4d"].gpu.kernel_overhead_ns / 1e3
    launch = host_costs_for("0.19.8").launch_ns / 1e3
    return (f"{device}: kernel then .item() {us['kernel_then_item']:.1f} us (commsim: launch {launch:.1f} + kernel "
            f"{kern:.1f} + small copy {copy:.1f} us); pageable torch.ones(1).to(cuda) {us['pageable_h2d']:.1f} us "
            f"(small copy {copy:.1f} us); idle synchronize {us['idle_synchronize']:.1f} us; a small op's launch "
            f"{us['launch']:.1f} us on the host (commsim's p4d: {launch:.1f} us)")


# ---------------------------------------------------------------- host speed
HOST_SPEED_RUN = ("--steps", "6", "--world", "8", "--flush-repeats", "1")


def host_speed_ratios(doc: dict) -> dict[str, float]:
    """Each routine's time in a ``runtime.ds_host_costs`` measurement of DeepSpeed 0.19.8
    at 8 ranks over what commsim's table (``knobs.HOST_COSTS``) charges for it at 8 ranks.
    The launches are compared without the CUDA driver's part the table adds
    (``ds_host_derive.CUDA_LAUNCH_NS``), which the measurement cannot see."""
    from commsim.strategies.knobs import host_costs_for
    from runtime.ds_host_derive import CUDA_LAUNCH_NS

    c, world = host_costs_for("0.19.8"), doc["world"]
    fits, prim = doc["fits"], doc["primitives"]
    pairs = {
        "module hook": (fits["fetch"]["fixed_ns"], c.module_hook_ns),
        "gather a parameter": (fits["fetch"]["per_gathered_ns"], c.gather_param_ns + world * c.gather_param_rank_ns),
        "wait for a parameter": (fits["fetch"]["per_waited_ns"], c.wait_param_ns + world * c.wait_param_rank_ns),
        "release hook": (fits["release"]["fixed_ns"], c.release_hook_ns),
        "free a parameter": (fits["release"]["per_freed_ns"], c.free_param_ns),
        "gradient hook": (fits["grad_hook"]["fixed_ns"], c.grad_hook_ns),
        "a torch op's dispatch": (prim["torch_op_ns"], c.launch_ns - CUDA_LAUNCH_NS),
        "a c10d collective call": (prim["c10d_all_gather_ns"], c.collective_launch_ns - CUDA_LAUNCH_NS),
    }
    return {name: measured / table for name, (measured, table) in pairs.items()}


def host_speed_line(ratios: dict[str, float], cpu: str) -> str:
    scale = statistics.median(ratios.values())
    return (f"{cpu}: DeepSpeed 0.19.8's routines take " + ", ".join(f"{k} x{v:.2f}" for k, v in ratios.items())
            + f" the table's time; median x{scale:.2f}: --host-scale {scale:.2f} prices this host")


# ---------------------------------------------------------------- device memory
def device_memory(torch) -> dict[str, int]:
    """Bytes of the current CUDA device: its total, what is in use on it (``cudaMemGetInfo``)
    and what PyTorch's caching allocator reserves; in use less reserved is this process's
    CUDA context (on a device no other process uses) with the kernels loaded so far."""
    free, total = torch.cuda.mem_get_info()
    return {"total": total, "in_use": total - free, "reserved": torch.cuda.memory_reserved()}


def device_memory_line(mem: dict[str, int], device: str, preset: tuple[str, str] | None) -> str:
    from commsim.hardware.specs import NODE_PRESETS

    gib = 2**30
    context = mem["in_use"] - mem["reserved"]
    line = (f"{device}: {mem['total'] / gib:.2f} GiB in all as CUDA reports it, {context / 2**20:.0f} MiB held by "
            f"this process's CUDA context (in use {mem['in_use'] / 2**20:.0f} MiB less the caching allocator's "
            f"{mem['reserved'] / 2**20:.0f} MiB)")
    if preset is not None:
        hbm = NODE_PRESETS[preset[1]].gpu.hbm_bytes
        line += (f"; commsim's {preset[0]} gives its caching allocator {hbm / gib:.2f} GiB, "
                 f"{hbm / mem['total']:.1%} of it")
    return line


# ---------------------------------------------------------------- presets
def preset_for(device: str):
    """(label, cluster name) of the node preset whose GPU is ``device`` (a CUDA device
    name), registering a p5 node with H200s for an H200; None for other GPUs."""
    from commsim.hardware import specs

    name = device.upper()
    if "A100" in name:
        return ("dgx-a100", "dgx-a100") if "80GB" in name.replace(" ", "") else ("p4d", "p4d")
    if "H100" in name:
        return "p5", "p5"
    if "H200" in name:
        # no node preset has H200s: p5's node (PCIe 5, NVSwitch) with them, here only
        key = "gpu-check-h200"
        specs.NODE_PRESETS.setdefault(key, replace(specs.NODE_PRESETS["p5"], name=key, gpu=specs.H200))
        return "p5 node with H200 (H200-SXM-141GB)", key
    return None


# ---------------------------------------------------------------- the checks
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timeout", type=float, default=450.0,
                    help="seconds for all checks together (default 450; the whole run stays under 8 minutes)")
    ap.add_argument("--keep", metavar="DIR", help="write the schedules, profile and traces here (default: a "
                    "temporary folder, removed)")
    ap.add_argument("--cpu", action="store_true",
                    help="rehearse on this machine's CPU with gloo and the tiny model (for tests; figures mean nothing)")
    args = ap.parse_args(argv)
    if not args.cpu:
        problem = no_gpu()
        if problem:
            print(f"gpu_check: {problem}", file=sys.stderr)
            return 2
    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
        return run_checks(args, Path(args.keep))
    with tempfile.TemporaryDirectory(prefix="commsim-gpu-check-") as work:
        return run_checks(args, Path(work))


def run_checks(args: argparse.Namespace, work: Path) -> int:
    from commsim.api import Scenario, predict
    from commsim.ir.trace import Trace

    run = Runner(args.timeout)
    backend = "gloo" if args.cpu else "nccl"
    shape = CPU_RUN if args.cpu else GPU_RUN
    sched, tiny, prof, meas, checked = (work / n for n in ("schedule.json", "tiny.json", "profile.json",
                                                            "measured.json", "checked.json"))
    state: dict[str, object] = {}
    failed = 0

    def check(name: str, fn, needs: tuple[str, ...] = ()) -> None:
        nonlocal failed
        missing = [n for n in needs if n not in state]
        if missing:
            print(f"{name}: skipped (needs {', '.join(missing)})", flush=True)
            return
        t = time.monotonic()
        try:
            line = fn()
        except CheckFailed as e:
            failed += 1
            print(f"{name}: FAILED: {e}", flush=True)
            return
        except OutOfTime:
            failed += 1
            print(f"{name}: FAILED: not finished within --timeout {args.timeout:.0f} s", flush=True)
            return
        state[name] = True
        print(f"{name}: {line} [{time.monotonic() - t:.0f} s]", flush=True)

    def schedule() -> str:
        if args.cpu:
            model, what = "tiny", "tiny"
        else:
            cfg = work / "llama2-7b-4-layers" / "config.json"
            cfg.parent.mkdir(exist_ok=True)
            cfg.write_text(json.dumps(LLAMA_4L, indent=1))
            model, what = str(cfg), "Llama-2-7B's shape, 4 layers (hidden 4096, FFN 11008)"
        run.commsim("schedule", "--model", model, "--nodes", "1", "--gpus-per-node", "1", "--micro-batch",
                    str(shape["micro_batch"]), "--seq", str(shape["seq"]), "-o", str(sched))
        run.commsim("schedule", "--model", "tiny", "--nodes", "1", "--gpus-per-node", "1", "--micro-batch", "2",
                    "--seq", "16", "-o", str(tiny))
        from commsim.ir import ops as O
        from commsim.ir.load import load_schedule_any

        s = load_schedule_any(str(sched))
        step = s.program_of(0).step
        shapes = {(op.gemm.m, op.gemm.n, op.gemm.k, op.gemm.batch) for op in step
                  if isinstance(op, O.Compute) and op.gemm is not None}
        return (f"{what}, ZeRO-3 {s.meta.precision}, micro-batch {shape['micro_batch']} x {shape['seq']}, world size 1: "
                f"{len(step)} ops per step, {len(shapes)} GEMM shapes")

    def calibrate() -> str:
        t = time.monotonic()
        run.commsim("calibrate", "--backend", backend, "--nproc-per-node", "1", "--schedule", str(sched),
                    *(["--quick"] if args.cpu else []), "-o", str(prof))
        p = json.loads(prof.read_text())
        state["device"] = p["devices"][0]
        gemm = max(p["gemm_by_dtype"][p["default_dtype"]], key=lambda pt: pt[1])
        pts = p["elementwise_points"]
        c = p["copy"]
        stats = p.get("allocator", {})
        side = round((gemm[0] / 2) ** (1 / 3))  # the square GEMM of as many flops
        return (f"{time.monotonic() - t:.0f} s on {', '.join(p['devices'])}: {p['default_dtype']} GEMM up to "
                f"{gemm[1] / 1e12:.2f} TFLOP/s (at {side}^3 or its flops), memory-bound "
                f"{pts[-1][0] / pts[-1][1] / 1e9:.0f} GB/s at {pts[-1][0] / 2**20:.0f} MiB, kernel "
                f"{p['kernel_overhead_ns'] / 1e3:.1f} us, H2D {c['h2d_bytes_per_s'] / 1e9:.1f} GB/s, D2H "
                f"{c.get('d2h_bytes_per_s', c['h2d_bytes_per_s']) / 1e9:.1f} GB/s; allocator retries "
                f"{stats.get('num_alloc_retries', 'n/a')}")

    def execute() -> str:
        run.commsim("execute", str(sched), "--backend", backend, "--nproc-per-node", "1", "--steps",
                    str(shape["steps"]), "--warmup", str(shape["warmup"]), "--timeout", "120", "-o", str(meas))
        t = Trace.load(meas)
        steps = [s / 1e6 for s in t.meta.get("step_times_ns")]
        state["measured_step_s"] = statistics.median(steps) / 1e3
        mem = t.meta.get("memory_stats_rank0") or {}
        line = (f"{len(steps)} measured steps after {shape['warmup']} warm-up: median {statistics.median(steps):.1f} ms "
                f"({min(steps):.1f}-{max(steps):.1f})")
        if mem:
            own = t.meta.get("executor_own_device_bytes_rank0") or 0
            line += (f"; peak reserved {mem.get('reserved_bytes.all.peak', 0) / 1e9:.2f} GB "
                     f"({own / 1e9:.2f} GB of it the executor's own), retries {mem.get('num_alloc_retries', 0)}")
        return line

    def check_data() -> str:
        run.commsim("execute", str(tiny), "--backend", backend, "--nproc-per-node", "1", "--steps", "1", "--warmup",
                    "1", "--check-data", "--timeout", "60", "-o", str(checked))
        n = sum(1 for r in Trace.load(checked).records if r.kind in DEVICE_OPS[5:9])
        return f"every collective's result exact (tiny model, bf16, {n} collectives checked)"

    preds: dict[str, object] = {}

    def predict_with(label: str, sc) -> str:
        if run.left() <= 1:
            raise OutOfTime()
        try:
            p = predict(sc)
        except ValueError as e:  # CommsimInputError: one line
            raise CheckFailed(str(e)) from None
        preds[label] = p
        measured = state["measured_step_s"]
        return (f"step {p.metrics.step_time_s * 1e3:.1f} ms vs measured {measured * 1e3:.1f} ms "
                f"({rel(p.metrics.step_time_s, measured)})")

    def predict_profile() -> str:
        return predict_with("profile", Scenario(schedule=str(sched), nodes=1, gpus_per_node=1, hw_profile=str(prof),
                                                runner="executor"))  # the executor ran it

    def predict_preset() -> str:
        found = None if args.cpu else preset_for(str(state.get("device", "")))
        if found is None:
            state["no preset"] = True
            raise CheckFailed(f"no preset for {state.get('device', 'this device')!r} (presets: A100, H100, H200)") \
                if not args.cpu else CheckFailed("no preset for a CPU (rehearsal)")
        label, cluster = found
        return f"{label}: " + predict_with("preset", Scenario(schedule=str(sched), cluster=cluster, nodes=1,
                                                              gpus_per_node=1))

    def ops(label: str):
        def compare() -> str:
            return error_line(per_kind_errors(preds[label].trace(), Trace.load(meas)))
        return compare

    def memory() -> str:
        t = Trace.load(meas)
        mem = t.meta.get("memory_stats_rank0") or {}
        if not mem:
            return "skipped: no caching allocator on this backend (gloo)"
        own = t.meta.get("executor_own_device_bytes_rank0") or 0
        reserved = mem.get("reserved_bytes.all.peak", 0) - own
        retries = mem.get("num_alloc_retries", 0)
        sims = [(label, p.metrics) for label, p in preds.items()]
        return (f"peak reserved measured {reserved / 1e9:.2f} GB (rank 0, less {own / 1e9:.2f} GB the executor's "
                f"own) vs simulated " + ", ".join(f"{m.peak_reserved_bytes / 1e9:.2f} GB ({label}, "
                                                 f"{rel(m.peak_reserved_bytes, reserved)})" for label, m in sims)
                + f"; allocator retries measured {retries}, simulated "
                + ", ".join(f"{m.alloc_retries} ({label})" for label, m in sims))

    check("schedule", schedule)
    check("calibrate", calibrate, ("schedule",))
    check("execute", execute, ("schedule",))
    check("check-data", check_data, ("schedule",))
    check("predict with the profile", predict_profile, ("calibrate", "execute"))
    if args.cpu:
        print("predict with the preset: none (CPU rehearsal)", flush=True)
    else:
        check("predict with the preset", predict_preset, ("calibrate", "execute"))
    check("ops vs the profile", ops("profile"), ("predict with the profile",))
    if not args.cpu:
        check("ops vs the preset", ops("preset"), ("predict with the preset",))
    check("memory", memory, ("execute", "predict with the profile"))

    def host_speed() -> str:
        out = work / "host-costs-0.19.8.json"
        # the table's conditions: DeepSpeed's CPU accelerator, no GPU in sight
        env = dict(os.environ, DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="",
                   PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        if run.left() <= 1:
            raise OutOfTime()
        try:
            done = subprocess.run([sys.executable, "-m", "runtime.ds_host_costs", "--deepspeed", "0.19.8", "-o",
                                   str(out), *HOST_SPEED_RUN], capture_output=True, text=True, cwd=ROOT, env=env,
                                  timeout=run.left())
        except subprocess.TimeoutExpired:
            raise OutOfTime() from None
        if done.returncode != 0:
            lines = [ln for ln in done.stderr.strip().splitlines() if ln.strip()] or [f"exit {done.returncode}"]
            raise CheckFailed(f"runtime.ds_host_costs exited {done.returncode}: {lines[-1].strip()}")
        doc = json.loads(out.read_text())
        return host_speed_line(host_speed_ratios(doc), doc["machine"]["cpu"])

    check("host speed", host_speed)
    if args.cpu:
        print("host round trips: none (CPU rehearsal)", flush=True)
        print("device memory: none (CPU rehearsal)", flush=True)
    else:
        import torch

        check("host round trips", lambda: round_trip_line(round_trips_us(torch), torch.cuda.get_device_name()))
        check("device memory", lambda: device_memory_line(device_memory(torch), torch.cuda.get_device_name(),
                                                          preset_for(torch.cuda.get_device_name())))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
