"""The 2022 ZeRO-3 optimisations as independent knobs, and the host-cost table.

Each knob switches one mechanism of reference/deepspeed-zero3.md ("The 2022
optimizations"); ``baseline`` is DeepSpeed ZeRO-3 of late 2021, ``optimized`` the
state after the two upstream changes (late 2021, January 2022). The presets differ in
exactly these fields.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from commsim.ir.errors import CommsimInputError


@dataclass(frozen=True, slots=True)
class Knobs:
    # Compute waits on the all-gather stream's events; off: the host synchronises the
    # whole device after every all-gather (compute then waits on the host).
    fine_grained_sync: bool = True
    # Fetch / prefetch / release decided from a precomputed queue; off: Python walks
    # the parameter trace for every submodule every step (host time per parameter).
    precomputed_fetch: bool = True
    # One coalesced all-gather per fetch and one reduce-scatter per gradient bucket;
    # off: one collective per parameter / gradient.
    coalesced_collectives: bool = True
    # *_base / into_tensor collectives on pre-flattened buffers; off: each collective
    # flattens into an extra buffer (an allocation and a device copy).
    flat_collectives: bool = True
    # Persistent parameters moved into one contiguous buffer at init; off: one small
    # allocation each (fragments the caching allocator's pools).
    defragment_persistent: bool = True
    # Gradient norm from stacked per-parameter norms with one reduction; off: one
    # .item() (device->host copy and host sync) per parameter.
    fused_grad_norm: bool = True
    # Tensor ops inside debug-string formatting: a norm, device->host copy and host
    # sync per fetched submodule. On in the baseline.
    debug_string_ops: bool = False
    # Host blocks on the oldest fetch / reduce event when more than this many are
    # outstanding; 0: unbounded.
    max_outstanding_coalesced: int = 2

    def as_pairs(self) -> tuple[tuple[str, bool | int], ...]:
        return tuple((f.name, getattr(self, f.name)) for f in fields(self))


KNOB_PRESETS: dict[str, Knobs] = {
    "optimized": Knobs(),
    "baseline": Knobs(
        fine_grained_sync=False,
        precomputed_fetch=False,
        coalesced_collectives=False,
        flat_collectives=False,
        defragment_persistent=False,
        fused_grad_norm=False,
        debug_string_ops=True,
        max_outstanding_coalesced=0,
    ),
}


def knobs_from(preset: str, overrides: list[str] | tuple[str, ...] = ()) -> Knobs:
    """A preset with ``NAME=VALUE`` overrides (the ``--knob`` flag)."""
    if preset not in KNOB_PRESETS:
        raise CommsimInputError(f"--preset {preset!r}: allowed: {', '.join(KNOB_PRESETS)}")
    knobs = KNOB_PRESETS[preset]
    names = {f.name: f for f in fields(Knobs)}
    for item in overrides:
        name, eq, raw = item.partition("=")
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
    """Host (Python) time per action, in ns.

    These are first estimates with their reasoning; ``commsim calibrate
    --deepspeed-host-costs`` measures the hook costs of the real DeepSpeed on the user's
    machine, and a profile carrying them replaces these (``host_costs_from``).
    """

    # Eager PyTorch dispatch + CUDA launch of one kernel: about 5-10 us on a modern
    # CPU (PyTorch dispatcher overhead; NVIDIA's launch latency about 5 us).
    launch_ns: int = 6_000
    # A collective call through torch.distributed (argument checks, work object).
    collective_launch_ns: int = 20_000
    # DeepSpeed's pre/post-forward and backward hooks per submodule (Python).
    module_hook_ns: int = 30_000
    # DeepSpeed's per-parameter gradient hook / reduction bookkeeping (Python).
    grad_hook_ns: int = 10_000
    # Baseline fetch decision: Python work per parameter of the trace it examines.
    fetch_decision_per_param_ns: int = 2_000
    # Formatting a debug string with tensor ops (beyond the device sync it forces).
    debug_string_ns: int = 20_000
    # CPU Adam (offload_optimizer: cpu), per fp32 parameter of this rank's partition, in
    # picoseconds. DeepSpeedCPUAdam is memory-bound: it reads param, grad, exp_avg,
    # exp_avg_sq (16 B) and writes param, exp_avg, exp_avg_sq and the 16-bit copy (14 B).
    # A p4d.24xlarge host has 2 Xeon 8275CL sockets x 6 DDR4-2933 channels = 281 GB/s
    # peak (Intel ARK); shared by its 8 ranks at a STREAM-like 70% that is 24.6 GB/s per
    # rank, so 30 B take about 1.2 ns.
    cpu_adam_ps_per_param: int = 1_200


def host_costs_from(obj: object, where: str) -> HostCosts:
    """HostCosts from a profile's ``host_costs`` object (unknown keys refused)."""
    if not isinstance(obj, dict):
        raise CommsimInputError(f"{where}: host_costs must be an object of name: ns")
    names = {f.name for f in fields(HostCosts)}
    values = {}
    for k, v in obj.items():
        if k in ("source",):
            continue
        if k not in names:
            raise CommsimInputError(f"{where}: host_costs.{k}: unknown; allowed: {', '.join(sorted(names))}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise CommsimInputError(f"{where}: host_costs.{k}: must be a number of ns >= 0, got {v!r}")
        values[k] = int(v)
    return replace(HostCosts(), **values)
