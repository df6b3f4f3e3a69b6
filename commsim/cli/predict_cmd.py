"""``commsim predict``: simulate one training step and report it, as a table or JSON,
with optional trace (commsim's, Chrome's or Kineto's), timeline and memory plot files."""

from __future__ import annotations

import argparse
import json
import math

from commsim.cli.common import add_hardware_flags, add_scenario_flags, check_outputs, warn_what_ifs
from commsim.cli.export_cmd import check_kineto_folder


def _fmt_bytes(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


# the share of the step the compute stream waits on the host above which the report says
# how to price a slower host
HOST_BOUND_SHARE = 0.05


def report_lines(pred, seed: int) -> list[str]:
    """The text report of a prediction (``seed``: the first seed asked for)."""
    m = pred.metrics
    out = [pred.title]
    out.extend(pred.sources)
    mode = ("symmetric: one rank simulated for identical ranks" if m.mode == "symmetric"
            else f"per-rank: {len(pred.result.ranks)} ranks simulated, jitter {m.jitter:.1%}")
    if m.host_jitter:
        mode += (f"; host jitter {m.host_jitter:.1%} (each host op's sd: every collective after a synchronisation "
                 "waits for the latest rank, shown as straggler time)")
    if m.host_gc:
        aligned = m.host_gc[2] == "aligned"
        mode += (f"; a full garbage collection every {m.host_gc[0]:g} steps per rank, {m.host_gc[1] * 1e3:g} ms, "
                 + ("every rank's at the same point (the job pays one rank's passes), " if aligned else
                    "each rank at its own phase (the others wait for it at their next collective), ")
                 + (f"{m.host_gc_pause_s:.3f} s of host time a step "
                    f"({'one rank' if aligned else 'every rank'}'s passes)" if m.mode == "symmetric"
                    else f"{m.host_gc_pause_s:.3f} s of host time this step (the reported rank's own passes)"))
    if pred.result.cpu_sharing:
        mode += f"; {pred.result.cpu_sharing}"
    if m.step_time_samples_s:
        n = len(m.step_time_samples_s)
        lo, hi = min(m.step_time_samples_s), max(m.step_time_samples_s)
        out.append(f"mode: {mode}; seeds {seed}-{seed + n - 1}, the median one shown (seed {m.seed})")
        slow = m.rank_noise_slow
        out.append(f"rank speed drift: sd {m.rank_noise[0]:.1%}, correlation {m.rank_noise[1] * 1e3:.0f} ms"
                   + (f", and sd {slow[0]:.1%}, correlation {slow[1] * 1e3:.0f} ms" if slow[0] else "") + " (profile); "
                   + (f"rank stalls: {m.rank_stalls[0]:.0f} a second of work, {m.rank_stalls[1]:.1%} of it (profile); "
                      if m.rank_stalls[0] else "") + f"the {n} steps took {lo:.3f}-{hi:.3f} s")
    else:
        out.append(f"mode: {mode}; seed {m.seed}")
    if m.oom:
        out.append(f"OUT OF MEMORY: {m.oom}")
        return out
    out.append(f"{'step time':<22}{m.step_time_s:>10.3f} s")
    out.append(f"{'tokens/s':<22}{m.tokens_per_s:>10,.0f}")
    out.append(f"{'model TFLOPS/GPU':<22}{m.model_tflops_per_gpu:>10.1f}     hardware TFLOPS/GPU "
               f"{m.hardware_tflops_per_gpu:.1f}")
    out.append(f"{'compute busy':<22}{m.compute_busy_frac:>10.1%}")
    out.append(f"{'communication':<22}{m.comm_time_s:>10.3f} s   exposed {m.exposed_comm_s:.3f} s, "
               f"overlap {m.overlap_frac:.1%}")
    out.append("compute-stream idle by cause:")
    for cause, v in sorted(m.stalls_s.items(), key=lambda kv: -kv[1]):
        if v >= 0.0005:  # below the table's resolution
            out.append(f"  {cause:<20}{v:>10.3f} s")
    sc = pred.scenario
    if m.stalls_s.get("host", 0.0) >= HOST_BOUND_SHARE * m.step_time_s and not sc.get("hw_profile") \
            and sc.get("host_scale", 1.0) == 1:
        # a host-bound step depends on the host's speed, which the presets take from one core
        out.append("  (host: the framework's Python and launches as timed on one core; "
                   "--host-scale S prices hosts S times slower)")
    out.append(f"{'memory':<22}peak allocated {_fmt_bytes(m.peak_allocated_bytes)}, reserved "
               f"{_fmt_bytes(m.peak_reserved_bytes)} of {_fmt_bytes(pred.hbm_bytes)}; allocator retries "
               f"{m.alloc_retries}, cache flushes {m.alloc_flushes}")
    if m.allocator_settled is False and m.warmup_steps:
        out.append(f"  (not settled: after {m.warmup_steps} warm-up steps the measured step still cudaMalloc'd "
                   f"{_fmt_bytes(m.new_segment_bytes)} of new segments; the pool may grow further, up to a cache "
                   "flush)")
    first = pred.result.ranks[min(pred.result.ranks)]
    fresh = first.fresh_page_bytes
    if fresh:  # a CPU run: the host pages a framework's tensors and gloo's temporaries first write, a step
        out.append(f"{'fresh host pages':<22}" + ", ".join(f"{p} {b / 2**20:.0f} MiB" for p, b in fresh.items())
                   + " a step (rank 0; the first write of each faults)")
    reported = first.reported_page_bytes
    if reported:  # a VM that reports free memory: large blocks on pages its host dropped
        out.append(f"{'reported host pages':<22}" + ", ".join(f"{p} {b / 2**20:.0f} MiB" for p, b in reported.items())
                   + " a step (rank 0; large blocks on pages the VM has reported to its host)")
    if m.cost_usd_per_step == m.cost_usd_per_step and m.cost_usd_per_step > 0:
        per_tokens = (f"${m.cost_usd_per_million_tokens:.2f} per million tokens"
                      if math.isfinite(m.cost_usd_per_million_tokens) else "no tokens (the schedule names no model)")
        out.append(f"{'cost':<22}${m.cost_usd_per_step:.3f} per step, {per_tokens}")
    return out


def cmd_predict(args: argparse.Namespace) -> int:
    from commsim.api import predict_scenario

    check_outputs(("--trace", args.trace), ("--plot", args.plot), ("--plot-memory", args.plot_memory))
    check_kineto_folder(args.kineto)
    warn_what_ifs(args.cluster, args.gpus_per_node)
    pred = predict_scenario(args)
    m = pred.metrics
    if args.trace:
        pred.trace().save_chrome_trace(args.trace) if args.trace.endswith(".chrome.json") else pred.trace().save(args.trace)
    if args.kineto:
        from commsim.report.kineto import write_kineto

        write_kineto(pred.trace(), args.kineto, world_size=pred.schedule.world_size)
    if args.plot:
        from commsim.report.plots import timeline_png

        timeline_png(pred.result, args.plot, title=pred.title)
    if args.plot_memory:
        from commsim.report.plots import memory, save_png

        save_png(memory(pred.result, title=pred.title, hbm_bytes=pred.hbm_bytes), args.plot_memory)
    if args.json:
        out = m.to_json()
        out["scenario"] = pred.scenario
        out["hardware_sources"] = list(pred.sources)
        print(json.dumps(out, indent=1, default=str))
        return 0 if m.oom is None else 1
    print("\n".join(report_lines(pred, args.seed)))
    return 0 if m.oom is None else 1


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("predict", help="simulate a training step and report step time, overlap and stalls",
                       description="Simulate one steady-state training step (after warm-up steps that let the caching "
                       "allocator settle) and report "
                       "step time, throughput, overlap, stalls of the compute stream by cause, memory and cost. "
                       "Defaults: the seed scenario, roberta-10b on 8 p4d nodes, ZeRO-3 as DeepSpeed 0.19.8, micro-batch 16, "
                       "sequence 512, bf16 (fp16 on V100, which has no bf16 tensor cores), layer-wise checkpointing.")
    add_scenario_flags(p)
    add_hardware_flags(p)
    p.add_argument("--schedule", metavar="FILE", help="simulate this schedule file instead of generating one")
    p.add_argument("--trace", metavar="FILE",
                   help="write the predicted trace (commsim JSON; a name ending .chrome.json writes Chrome/Perfetto)")
    p.add_argument("--kineto", metavar="DIR",
                   help="write the predicted step as PyTorch profiler (Kineto) traces, DIR/rank<N>.pt.trace.json for "
                   "every rank, for HTA, Perfetto and TensorBoard (DIR: new or empty)")
    p.add_argument("--plot", metavar="PNG", help="write a timeline plot of the step")
    p.add_argument("--plot-memory", metavar="PNG",
                   help="write allocated / reserved memory over the step, allocator flushes marked")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(func=cmd_predict)
