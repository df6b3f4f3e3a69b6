"""What every subcommand shares: the one-line-error parser, flag types and flag groups,
checks of output paths made before any work, and warnings.

Usage errors and input errors alike become a ``CommsimInputError``, which ``main``
prints as one line (``commsim: error: ...``) and turns into exit status 2.
"""

from __future__ import annotations

import argparse
import sys

from commsim.ir.errors import CommsimInputError

EXIT_BAD_INPUT = 2


class Parser(argparse.ArgumentParser):
    """argparse, but usage errors are one line (and still exit 2)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        # main() adds the one "commsim: error:" prefix; the help hint names the subcommand
        raise CommsimInputError(f"{message} (see '{self.prog} --help')")


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def need_torch(what: str) -> None:
    """A clear error, before any work, when a command that runs ranks has no torch."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        raise CommsimInputError(f"{what} needs torch: pip install 'commsim[runtime]'")


def add_scenario_flags(p: argparse.ArgumentParser) -> None:
    """Flags that describe a model, a world and a DeepSpeed config (schedule, predict)."""
    p.add_argument("--model", default="roberta-10b",
                   help="model preset, path to a Hugging Face config.json, or module:function returning a "
                   "torch.nn.Module (walked on the meta device; needs torch) (default roberta-10b)")
    p.add_argument("--strategy", choices=("deepspeed", "fsdp2", "fsdp1"), default="deepspeed",
                   help="deepspeed: DeepSpeed ZeRO from --ds-config, --stage, --preset, --knob (default); fsdp2: "
                   "PyTorch FSDP2, fully_shard on every transformer block and the root, from --fsdp-config; fsdp1: "
                   "PyTorch FSDP1, FullyShardedDataParallel around every block and the root, from --fsdp-config")
    p.add_argument("--fsdp-config", metavar="FILE",
                   help="FSDP2 settings JSON, keys as fully_shard's arguments (default: the seed scenario's, "
                   "{\"mp_param_dtype\": \"bf16\", \"mp_reduce_dtype\": \"fp32\"}, fp16 on a GPU without bf16 tensor cores (V100); "
                   "{} is FSDP2's own defaults, fp32): "
                   "reshard_after_forward (true, false or a group size k: reshard to k ranks), "
                   "root_reshard_after_forward (null: FSDP2's default, the root keeps its parameters), "
                   "mp_param_dtype / mp_reduce_dtype (MixedPrecisionPolicy: null, bf16, fp16, fp32), offload and "
                   "offload_pin_memory (CPUOffloadPolicy), hsdp_replicas (HSDP: a replicas x world/replicas mesh, "
                   "sharded inside), forward_prefetch / backward_prefetch (explicit prefetch of the next / previous "
                   "N blocks; 0: FSDP2's implicit prefetching), gradient_accumulation_steps, requires_gradient_sync "
                   "(false: reduce at the last micro-step only); with --strategy fsdp1, FullyShardedDataParallel's: "
                   "sharding_strategy (FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD: sharded inside a node), "
                   "mp_param_dtype / mp_reduce_dtype (MixedPrecision), limit_all_gathers (true), backward_prefetch "
                   "(BACKWARD_PRE, BACKWARD_POST, null); checkpointing comes from --no-checkpointing and "
                   "--checkpoint-style")
    p.add_argument("--nodes", type=positive_int, default=8, help="number of nodes (default 8)")
    p.add_argument("--gpus-per-node", type=positive_int, help="GPUs per node (default: the cluster's, 8)")
    p.add_argument("--cluster", default="p4d",
                   help="node preset: p4d (default), p5, dgx-a100, dgx-h100, p3dn, azure-ndm-a100")
    p.add_argument("--ds-config", metavar="FILE",
                   help="DeepSpeed config JSON (default: ZeRO-3, bf16 (fp16 on a GPU without bf16 tensor cores: V100), "
                   "DeepSpeed's defaults)")
    p.add_argument("--stage", type=int, choices=(0, 1, 2, 3), help="ZeRO stage (default 3, or the config's)")
    p.add_argument("--preset", default="current",
                   help="DeepSpeed ZeRO-3 release: current (0.19.8, default), optimized (0.6.0, after the seed's "
                        "changes), baseline (0.5.10, before them) or before-pr1188 (0.5.4, before DeepSpeed PR 1188's "
                        "gather and release changes)")
    p.add_argument("--knob", action="append", metavar="NAME=VALUE",
                   help="override one knob, e.g. --knob coalesced_collectives=false (repeatable); knobs: "
                   "fine_grained_sync, precomputed_fetch, coalesced_collectives, flat_reduce_scatter, "
                   "fused_grad_norm, fused_overflow_check, debug_string_ops, empty_gather_buffers, "
                   "preallocated_reduce_buffers, max_outstanding_coalesced")
    p.add_argument("--micro-batch", type=positive_int,
                   help="sequences per GPU per micro-step (default: the config's, else 16)")
    p.add_argument("--seq", type=positive_int, default=512, help="sequence length (default 512)")
    p.add_argument("--no-checkpointing", action="store_true",
                   help="disable layer-wise activation checkpointing (on by default)")
    p.add_argument("--checkpoint-style", choices=("reentrant", "non_reentrant"), default="reentrant",
                   help="torch.utils.checkpoint flavour: reentrant (Hugging Face's default) recomputes a layer "
                   "before its backward hooks; non_reentrant after the first one")


def add_hardware_flags(p: argparse.ArgumentParser, simulation: bool = True) -> None:
    """The fabric and measured profile (predict, sweep, tune), and the simulation mode flags."""
    p.add_argument("--net", choices=("efa", "ib"), help="inter-node fabric: efa or ib (default: the cluster's own)")
    p.add_argument("--nccl-stack", metavar="STACK",
                   help="software stack instead of the cluster's own: early-2022 (NCCL 2.11, aws-ofi-nccl 1.2), 2023 "
                   "(NCCL 2.18.5, aws-ofi-nccl 1.7.3) or 2025 (NCCL 2.27.7, aws-ofi-nccl 1.16.3): NCCL's algorithms, "
                   "protocols and channels, and the EFA plugin's settings (commsim/hardware/stacks.py)")
    p.add_argument("--hw-profile", metavar="FILE",
                   help="measured hardware profile (from commsim calibrate): its machine replaces the cluster's "
                   "hardware; the cluster lends only the world's shape and price, and naming another --cluster or a "
                   "--net asks for that GPU cluster, which only an nccl profile can price")
    p.add_argument("--runner", choices=("framework", "executor"), default="framework",
                   help="with --hw-profile: what runs the schedule on the profiled machine: a framework (DeepSpeed, "
                   "FSDP2), whose host cost is the schedule's own host ops and whose async_op=False collectives block "
                   "the host on a CPU (gloo) profile (default), or commsim's executor (commsim execute, to compare with "
                   "its traces), which replays the schedule as a GPU runs it and also pays its own per-op costs, "
                   "measured into the profile by calibrate")
    p.add_argument("--host-heap", action="store_true",
                   help="with a CPU --hw-profile and the framework runner: find a tensor's fresh pages with commsim's "
                   "model of glibc's heap (thresholds, growth, trims) fed the schedule's allocations, instead of "
                   "glibc's fixed 32 MiB ceiling alone (the default; traces/README.md compares both with real runs)")
    p.add_argument("--host-scale", type=float, default=1.0, metavar="SCALE",
                   help="how many times as long the GPU hosts' CPU takes for each host routine (the framework's "
                   "Python, kernel and collective launches) as the core commsim's host costs were measured on: every "
                   "host op of the schedule takes SCALE times its time, the host optimizer's (memory-bound) excepted "
                   "(default 1: as measured; docs/deepspeed-versions.md shows how much old DeepSpeed's ZeRO-3 "
                   "depends on it)")
    p.add_argument("--extrapolate", action="store_true",
                   help="with --hw-profile: price collectives over more ranks than the profile measured (or placed "
                   "across nodes when it measured one node) from its nearest measured group, with a warning, instead "
                   "of refusing the scenario")
    if not simulation:  # symmetric simulation, as the search compares configs, not noise
        p.set_defaults(mode="auto", seed=0, jitter=None, host_jitter=None, host_gc=None, warmup_steps=None)
        return
    p.add_argument("--mode", choices=("auto", "symmetric", "per-rank"), default="auto",
                   help="symmetric: simulate one rank for identical ranks (fast); per-rank: every rank, with "
                   "jitter, stragglers, per-rank allocator flushes and, from a profile that measured it, each rank's "
                   "speed drift (the median of 9 seeded steps) (default auto: symmetric when ranks are identical and "
                   "the profile measured no drift, then per-rank if the caching allocator flushed and there are at "
                   "most 64 ranks, since each rank's flush stalls the collectives it joins)")
    p.add_argument("--seed", type=int, default=0, help="seed of the per-rank jitter RNG (default 0)")
    p.add_argument("--warmup-steps", type=int, metavar="N",
                   help="simulate exactly N steps before the measured one (default: on GPUs until the caching "
                   "allocator settles, a step that still adds a segment being measured again, for at most 2 "
                   "warm-up steps; on CPUs 1). More shows how the pool grows over a longer run")
    p.add_argument("--jitter", type=float,
                   help="relative std-dev of compute kernel times per rank (default 0.01 per-rank, 0 symmetric)")
    p.add_argument("--host-jitter", type=float, metavar="SD",
                   help="relative std-dev of each host op's time (the framework's Python, the OS), independent per "
                   "op and rank: every collective after a synchronisation waits for the latest rank's host, which "
                   "grows with the ranks (default: the platform's; 0 on every GPU preset, not yet measured there)")
    p.add_argument("--host-gc", metavar="PERIOD_STEPS:PAUSE_MS[:aligned|independent]",
                   help="each rank's Python runs a full garbage collection every PERIOD_STEPS steps of its host "
                   "work, stopping its host PAUSE_MS; aligned (the default, measured for ZeRO-3's identical "
                   "ranks): every rank at the same point of the step, so the job pays one rank's passes; "
                   "independent (the default for ZeRO-2, whose ranks were measured drifting apart): each rank "
                   "at its own phase, the others waiting for it at their next collective (bench/gc_pauses.py "
                   "measures period and pause for a DeepSpeed release, bench/gc_alignment.py where the ranks' "
                   "passes fall; default: none, as a loop that turned the collector off)")


def check_outputs(*outputs: tuple[str, str | None]) -> None:
    """Before any work: every ``(flag, path)`` given can be written as a file (its folder
    exists and is writable, the path is not a folder)."""
    from commsim.util.files import output_problem

    for flag, path in outputs:
        if path is not None:
            problem = output_problem(path)
            if problem:
                raise CommsimInputError(f"{flag} {path}: {problem}")


def check_output_folder(flag: str, path: str) -> None:
    """Before any work: files can be written into the folder ``path`` (or it can be
    made: its parent exists)."""
    from commsim.util.files import output_folder_problem

    problem = output_folder_problem(path)
    if problem:
        raise CommsimInputError(f"{flag} {path}: {problem}")


def warn(message: str) -> None:
    """One line on stderr; the command goes on."""
    print(f"commsim: warning: {message}", file=sys.stderr)


def warn_what_ifs(cluster: str, gpus_per_node: int | None) -> None:
    """Warn about settings accepted as what-ifs that no real node of the preset has: more
    GPUs per node than the preset's (fewer, part of a node, is ordinary)."""
    from commsim.hardware.specs import NODE_PRESETS

    node = NODE_PRESETS.get(cluster)
    if node is not None and gpus_per_node is not None and gpus_per_node > node.gpus_per_node:
        warn(f"--gpus-per-node {gpus_per_node}: a {cluster} node has {node.gpus_per_node} GPUs; simulating "
             f"{gpus_per_node} per node as a what-if (its NVLink and NICs shared by all of them)")
