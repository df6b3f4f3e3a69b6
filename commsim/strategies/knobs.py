"""The seed's ZeRO-3 changes as independent knobs, the presets, and the host-cost table.

Each knob switches one mechanism that DeepSpeed 0.5.10 (late 2021) and 0.6.0 (early
2022, after the seed team's changes) implement differently; the comment above each
says what each side does, with file:line in the released sources
(``s3`` = deepspeed/runtime/zero/stage3.py, ``pp`` = .../partition_parameters.py,
``cc`` = deepspeed/runtime/comm/coalesced_collectives.py; docs/deepspeed-versions.md
has the whole table). True is 0.6.0's side.

A preset is a DeepSpeed version (``commsim.strategies.dsversions``: what differs
between versions but is not one of the seed's changes, such as the persistence rule)
plus the knobs: ``baseline`` = 0.5.10, ``optimized`` = 0.6.0, ``current`` = 0.19.8
(what today's users run; the fidelity tests record it). ``optimized`` and ``current``
set every knob the same way. ``before-pr1188`` = 0.5.4, the state before DeepSpeed PR
1188 (published-runs.md E2): the baseline's knobs on a release with that PR's four
changes undone.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from commsim.ir.errors import CommsimInputError


@dataclass(frozen=True, slots=True)
class Knobs:
    # Fetch synchronisation. 0.6.0: one event per waited in-flight parameter, the host
    # blocking only on the oldest beyond max_outstanding_coalesced, and the compute
    # stream's wait_stream on the all-gather stream (s3:316-335). 0.5.10: the host
    # synchronises the whole device before launching each prefetched all-gather
    # (pp:882), after a demand gather (pp:984), and, at a fetch that needs an in-flight
    # or unavailable parameter, the all-gather stream and then the device (s3:534-545).
    fine_grained_sync: bool = True
    # Prefetch and release decisions. 0.6.0: at every fetch, prefetch pops a queue built
    # from the trace recorded in the first step (s3:345-380), and a parameter is kept
    # when it is used again within max_reuse_distance (s3:444-466). 0.5.10: its
    # PrefetchCoordinator records the trace one position off the step counter it reads
    # it with (the root module's reset_step hook, s3:1364-1377, runs after the root's
    # own fetch hook, registered first, s3:1397-1509), so at every later position it
    # finds another module and neither prefetches (s3:220-225) nor keeps a parameter for
    # reuse (s3:254-258): every weight is gathered on demand at every use.
    precomputed_fetch: bool = True
    # 0.6.0: one all-gather per fetch and per prefetch batch (pp:813-890) and one
    # reduce-scatter per gradient bucket (cc:41-116). 0.5.10: one _all_gather_base per
    # parameter (pp:860-917, 919-986) and one reduce_scatter per gradient (pp:1050-1119).
    coalesced_collectives: bool = True
    # 0.6.0: _reduce_scatter_base on the interleaved flat buffer (cc:16-23). 0.5.10:
    # the list-API reduce_scatter (pp:1114-1117), whose input list ProcessGroupNCCL
    # flattens into a new buffer with a copy. (All-gathers are _all_gather_base in both
    # since DeepSpeed PR 1188: pp:893-898 in 0.5.10, pp:853-857 in 0.6.0.)
    flat_reduce_scatter: bool = True
    # 0.6.0: per-parameter fp64 norms stacked, one sum, one host read (s3:2291-2309).
    # 0.5.10: each parameter's norm read with .item() before the next (s3:2443-2450).
    fused_grad_norm: bool = True
    # 0.6.0: an inf/nan tracker updated on the reduce stream as each gradient shard is
    # stored (s3:2003-2010), read once in step() (s3:2729-2731). 0.5.10: per parameter
    # x.float().sum() read with float() (s3:2852-2857, 2892-2910): a cast, a sum, a
    # device->host copy and a host sync each.
    fused_overflow_check: bool = True
    # 0.5.10 formats f"... norm={param.norm()}" for every parameter of every fetched
    # module (s3:454-458): a norm kernel over the gathered parameter and, formatting the
    # 0-d tensor, an .item() (device->host copy, host sync) each, though nothing is
    # printed. 0.6.0's debug strings hold metadata only.
    debug_string_ops: bool = False
    # 0.6.0: gather buffers from torch.empty (pp:847, 865). 0.5.10: torch.zeros for
    # every prefetched parameter (pp:875): a memset of the gathered size on the
    # all-gather stream before its all-gather.
    empty_gather_buffers: bool = True
    # 0.6.0: the gradient bucket and the gradient partition allocated once (s3:777-801);
    # each gradient copied into the bucket on the reduce stream after a wait on the
    # compute stream (s3:1823-1836); the shard stored as soon as it is reduced
    # (s3:1970-2045). 0.5.10: one (two with overlap_comm) reduce_bucket_size buffers
    # made with torch.empty in every backward (s3:2929-2942) and dropped at its end
    # (s3:1565-1571); the partition made with torch.zeros at the first flush of each
    # step (s3:2063-2083); the copy into the bucket on the compute stream (s3:1903-1911);
    # the whole bucket buffer divided by the world size at every flush however full
    # (s3:1950-1951); shards copied a flush late on a third stream (s3:2092-2147).
    preallocated_reduce_buffers: bool = True
    # How many earlier fetch / reduce events may be outstanding before the host blocks
    # on the oldest: 2 in 0.6.0 (s3:238, 321-326, 808, 1857-1860). 0 = the host waits
    # for all earlier work first: 0.5.10 synchronises the reduction stream at every
    # bucket flush (s3:2159-2160, 2092-2093), so one bucket at most is in flight (its
    # fetches are host-synchronous through fine_grained_sync).
    max_outstanding_coalesced: int = 2

    def as_pairs(self) -> tuple[tuple[str, bool | int], ...]:
        return tuple((f.name, getattr(self, f.name)) for f in fields(self))


# 0.6.0's side of every knob; 0.19.8 kept all of them.
_AFTER = Knobs()
_BEFORE = Knobs(
    fine_grained_sync=False,
    precomputed_fetch=False,
    coalesced_collectives=False,
    flat_reduce_scatter=False,
    fused_grad_norm=False,
    fused_overflow_check=False,
    debug_string_ops=True,
    empty_gather_buffers=False,
    preallocated_reduce_buffers=False,
    max_outstanding_coalesced=0,
)

# preset -> (DeepSpeed version it models, knobs)
# (before-pr1188: DeepSpeed 0.5.4, E2's "before" in reference/published-runs.md; the
# seed's knobs on 0.5.10's side, PR 1188's changes are dsversions.py behaviours)
PRESET_VERSIONS: dict[str, str] = {"current": "0.19.8", "optimized": "0.6.0", "baseline": "0.5.10",
                                   "before-pr1188": "0.5.4"}
KNOB_PRESETS: dict[str, Knobs] = {"current": _AFTER, "optimized": _AFTER, "baseline": _BEFORE,
                                  "before-pr1188": _BEFORE}
DEFAULT_PRESET = "current"

# knob names of the releases before 0.6.0's changes were modelled one by one: the old
# flat_collectives flattened both collectives; 0.5.10 flattens only the reduce-scatter
_RENAMED = {"flat_collectives": "flat_reduce_scatter"}


def knobs_from(preset: str, overrides: list[str] | tuple[str, ...] = ()) -> Knobs:
    """A preset with ``NAME=VALUE`` overrides (the ``--knob`` flag)."""
    if preset not in KNOB_PRESETS:
        raise CommsimInputError(f"--preset {preset!r}: allowed: {', '.join(KNOB_PRESETS)}")
    knobs = KNOB_PRESETS[preset]
    names = {f.name: f for f in fields(Knobs)}
    for item in overrides:
        name, eq, raw = item.partition("=")
        if name in _RENAMED:
            raise CommsimInputError(f"--knob {item!r}: {name} is now {_RENAMED[name]} (DeepSpeed 0.5.10 already "
                                    "used _all_gather_base; only its reduce-scatter flattened a list)")
        if name == "defragment_persistent":
            raise CommsimInputError(f"--knob {item!r}: removed: neither DeepSpeed 0.5.10 nor 0.6.0 keeps persistent "
                                    "parameters in a contiguous buffer (both defragment only the shards, at init)")
        if not eq or name not in names:
            raise CommsimInputError(f"--knob {item!r}: expected NAME=VALUE with NAME one of {', '.join(names)}")
        if isinstance(getattr(knobs, name), bool):
            if raw.lower() not in ("true", "false", "1", "0", "on", "off"):
                raise CommsimInputError(f"--knob {item!r}: {name} takes true or false")
            value: bool | int = raw.lower() in ("true", "1", "on")
        else:
            try:
                value = int(raw)
            except ValueError:
                raise CommsimInputError(f"--knob {item!r}: {name} takes a non-negative integer") from None
            if value < 0:
                raise CommsimInputError(f"--knob {item!r}: {name} takes a non-negative integer")
        knobs = replace(knobs, **{name: value})
    return knobs


@dataclass(frozen=True, slots=True)
class HostCosts:
    """Host (Python) time per action on a p4d.24xlarge host, in ns.

    The DeepSpeed figures are each release's own routines timed on a CPU with their
    device calls replaced by no-ops (runtime/ds_host_costs.py; the table, machine and
    date are in traces/README.md), at two world sizes so that the loops over ranks
    scale (``*_rank_ns``: per rank of the partition group), times ds_host_costs.CPU_SCALE for
    the p4d host's CPU. Kernel and collective launches add a cited CUDA figure to the
    PyTorch / c10d dispatch measured the same way. ``HOST_COSTS`` holds one set per
    DeepSpeed release; the defaults here are 0.19.8's.
    """

    # One kernel launched from PyTorch eager mode (launch_ns) and one collective call
    # through torch.distributed (collective_launch_ns).
    launch_ns: int = 6_400
    collective_launch_ns: int = 14_000
    # A module's pre-forward / pre-backward hook (fetch): fixed, per parameter it
    # visits, per parameter it starts gathering, per parameter whose gather it completes.
    module_hook_ns: int = 26_300
    fetch_param_ns: int = 0
    gather_param_ns: int = 23_400
    gather_param_rank_ns: int = 300
    wait_param_ns: int = 26_900
    wait_param_rank_ns: int = 1_000
    # A module's post-forward / post-backward hook (release): fixed, per parameter it
    # visits, per parameter it frees.
    release_hook_ns: int = 20_600
    release_param_ns: int = 2_500
    free_param_ns: int = 41_600
    # Around each module hook call (fetch or release): PyTorch calling the hook, the
    # hook function, the autograd Functions wrapping the module's inputs and outputs
    # (their forward, and the backward that fires the backward hooks), parameter access
    # through ZeROOrderedDict (0.6.0 on); runtime/ds_host_plumbing.py.
    hook_plumbing_ns: int = 56_000
    # One PyTorch FSDP2 hook call (a unit's pre/post forward or backward, the root's final
    # callback): its Python, record_function scopes and the views that swap sharded and
    # unsharded parameters, beyond the copies, allocations and collectives the schedule
    # prices itself (runtime/fsdp2_host_costs.py; machine and scaling below HOST_COSTS).
    fsdp2_hook_ns: int = 296_400
    # One PyTorch FSDP1 hook call (the root's or a unit's pre-forward, a post-forward,
    # pre-backward or post-backward, the final callback): its Python, the views of the
    # flat parameter, record_function scopes, beyond the kernels, allocations and
    # collectives the schedule prices itself (runtime/fsdp1_host_costs.py; machine and
    # scaling below HOST_COSTS).
    fsdp1_hook_ns: int = 206_600
    # The per-parameter gradient hook (bucket bookkeeping, the copy call).
    grad_hook_ns: int = 23_300
    # A bucket flush: fixed, per rank (its partition bookkeeping), and per gradient in
    # it (its loops over the ranks).
    reduce_flush_ns: int = 215_100
    reduce_flush_rank_ns: int = 900
    reduce_param_ns: int = 15_600
    reduce_param_rank_ns: int = 2_900
    # Formatting one 0.5.10 debug string around a tensor op's result, beyond the op's
    # launch and the host sync its .item() forces (debug_string_ops).
    debug_string_ns: int = 0
    # A DTensor op's dispatch (sharding propagation, wrapping the local result) over a
    # plain tensor op's: FSDP2's parameters are DTensors, and on CPUs torch's AdamW runs
    # eight of them per parameter. bench/dtensor_dispatch.py on the AMD EPYC Zen 4 VM
    # core of the DeepSpeed figures (torch 2.13.0, 2026-12-01): 161 us per parameter's
    # single-tensor AdamW step as DTensors against 26.9 us as plain tensors, 16.8 us per op
    # (then the fastest of three; runtime/dtensor_dispatch.py now times it, and
    # ``calibrate --fsdp2-host-costs`` puts this machine's typical figure in a profile).
    dtensor_op_ns: int = 16_800
    # CPU Adam (offload_optimizer: cpu), per fp32 parameter of this rank's partition, in
    # picoseconds. DeepSpeedCPUAdam is memory-bound: it reads param, grad, exp_avg,
    # exp_avg_sq (16 B) and writes param, exp_avg, exp_avg_sq and the 16-bit copy (14 B).
    # A p4d.24xlarge host has 2 Xeon 8275CL sockets x 6 DDR4-2933 channels = 281 GB/s
    # peak (Intel ARK); shared by its 8 ranks at a STREAM-like 70% that is 24.6 GB/s per
    # rank, so 30 B take about 1.2 ns.
    cpu_adam_ps_per_param: int = 1_200

    def gather_ns(self, n_params: int, ranks: int) -> int:
        return n_params * (self.gather_param_ns + self.gather_param_rank_ns * ranks)

    def wait_ns(self, n_params: int, ranks: int) -> int:
        return n_params * (self.wait_param_ns + self.wait_param_rank_ns * ranks)

    def flush_ns(self, n_grads: int, ranks: int) -> int:
        return self.reduce_flush_ns + self.reduce_flush_rank_ns * ranks + \
            n_grads * (self.reduce_param_ns + self.reduce_param_rank_ns * ranks)


# DeepSpeed release -> its host costs: traces/host-costs/derived.json, fitted by
# ``python -m runtime.ds_host_costs --derive traces/host-costs/*.json`` from the six
# measurements beside it (each release at 8 and 64 ranks, on an AMD EPYC Zen 4 VM
# core, 2026-11-30; the table is in traces/README.md), times CPU_SCALE = 1.0 (no
# single-thread benchmark of that CPU and the p4d's Xeon 8275CL was at hand: see
# runtime/ds_host_costs.py). The launches (the same PyTorch for all three: the mean
# of the six runs) add cudaLaunchKernel's 3.8 us (NVIDIA Developer Blog, "Getting
# Started with CUDA Graphs", 2019) to a PyTorch op's dispatch (2.5-2.7 us) and to a
# c10d all_gather call (9.9-10.8 us, its fake backend at 8 ranks) measured here.
# 0.19.8's are the dataclass defaults. The hook plumbing (hook_plumbing_ns), which those
# six runs did not measure, was timed later on another machine (an AMD EPYC Zen 5 VM
# core, 2026-12-02: every release at 8 and 64 ranks, three processes each,
# traces/host-costs/plumbing/; 12.8 / 18.3 / 37.1 us per hook call there for 0.5.10 /
# 0.6.0 / 0.19.8) and scaled by each release's own ratio of the two machines on its
# timed routines (1.5-1.6x): ``python -m runtime.ds_host_costs --derive-plumbing
# traces/host-costs traces/host-costs/plumbing/deepspeed-*.json``.
# FSDP2's hooks (fsdp2_hook_ns, torch 2.13.0; the same in every preset: FSDP2 is not a
# DeepSpeed release) were timed on the Zen 5 core of the plumbing (2026-12-02, three
# processes, traces/host-costs/fsdp2/: 211.6 / 220.4 / 231.6 us per hook call there) and
# scaled like the plumbing, by that machine's ratio to the stored runs' on DeepSpeed
# 0.19.8's timed routines, from 0.19.8 runs at 8 and 64 ranks in the same minutes
# (1.40x): ``python -m runtime.fsdp2_host_costs --derive traces/host-costs
# traces/host-costs/fsdp2/*.json``.
# FSDP1's hooks (fsdp1_hook_ns, torch 2.13.0, every preset) were timed the same way on an
# AMD EPYC Zen 4 VM core (2026-12-05, three processes interleaved with DeepSpeed 0.19.8
# at 8 and 64 ranks, traces/host-costs/fsdp1/: 194.0 us per hook call there, the fastest
# FSDP1 step less the fastest plain one) and scaled by that machine's ratio to the
# stored runs' (1.065x): ``python -m runtime.fsdp1_host_costs --derive traces/host-costs
# traces/host-costs/fsdp1/*.json``.
HOST_COSTS: dict[str, HostCosts] = {
    "0.19.8": HostCosts(),
    "0.6.0": HostCosts(hook_plumbing_ns=29_100, module_hook_ns=35_900, fetch_param_ns=1_800, gather_param_ns=44_100,
                       gather_param_rank_ns=200, wait_param_ns=33_400, wait_param_rank_ns=1_200,
                       release_hook_ns=13_900, release_param_ns=1_500, free_param_ns=40_800, grad_hook_ns=26_000,
                       reduce_flush_ns=0, reduce_flush_rank_ns=0, reduce_param_ns=23_600,
                       reduce_param_rank_ns=3_400),
    "0.5.10": HostCosts(hook_plumbing_ns=20_000, module_hook_ns=16_400, fetch_param_ns=7_500, gather_param_ns=38_200, gather_param_rank_ns=0,
                        wait_param_ns=0, wait_param_rank_ns=0, release_hook_ns=4_900, release_param_ns=5_200,
                        free_param_ns=20_600, grad_hook_ns=16_400, reduce_flush_ns=400_300, reduce_flush_rank_ns=800,
                        reduce_param_ns=9_300, reduce_param_rank_ns=2_100, debug_string_ns=3_500),
}
# 0.5.4 (before-pr1188) runs 0.5.10's hooks, gradient path and flush (the same code);
# its gather path (_allgather_param, a Python loop over the ranks building the output
# list) and its release (torch.ones(1).to(device)) differ. Both releases were timed the
# same way on one later machine (an AMD EPYC Zen 5 VM core, 2026-12-02, three runs each
# at 8 and 64 ranks: traces/host-costs/pr1188/), where 0.5.4's gather cost 28.5 us + 2.0
# us per rank a parameter against 0.5.10's 18.2 us, and its free 12.1 against 10.6 us;
# the shared routines agreed within 3%. 0.5.4's are 0.5.10's figures above times those
# ratios (the per-rank term times the gather's own ratio between the two machines, 38.2 /
# 18.2), so that the two releases differ by their code, not by the machine:
# ``python -m runtime.ds_host_costs --derive-before-pr1188 traces/host-costs/derived.json
# traces/host-costs/pr1188/deepspeed-*.json``.
HOST_COSTS["0.5.4"] = replace(HOST_COSTS["0.5.10"], gather_param_ns=59_800, gather_param_rank_ns=4_200,
                              free_param_ns=23_500)


def host_costs_for(version: str) -> HostCosts:
    return HOST_COSTS[version]


def host_costs_from(obj: object, where: str, base: HostCosts | None = None) -> HostCosts:
    """HostCosts from a profile's ``host_costs`` object (unknown keys refused), over
    ``base`` (the preset's version's costs; the current version's by default)."""
    if not isinstance(obj, dict):
        raise CommsimInputError(f"{where}: host_costs must be an object of name: ns")
    names = {f.name for f in fields(HostCosts)}
    values = {}
    for k, v in obj.items():
        if k in ("source", "deepspeed"):
            continue
        if k not in names:
            raise CommsimInputError(f"{where}: host_costs.{k}: unknown; allowed: {', '.join(sorted(names))}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise CommsimInputError(f"{where}: host_costs.{k}: must be a number of ns >= 0, got {v!r}")
        values[k] = int(v)
    return replace(base or HostCosts(), **values)
