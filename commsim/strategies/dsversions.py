"""What differs between the DeepSpeed releases commsim models, beyond the seed's knobs.

The ZeRO-3 generator follows one release at a time: 0.5.4 (autumn 2021, the state
before DeepSpeed PR 1188: ``before-pr1188``), 0.5.10 (late 2021, the seed's
``baseline``), 0.6.0 (early 2022, ``optimized``) and 0.19.8 (``current``). The seed's
own changes between 0.5.10 and 0.6.0 are the knobs (knobs.py); this module holds the
other differences, each a behaviour with the line it comes from, so a knob flipped on
one release's preset changes only what the knob names. File references are to the
released sources: ``s3`` = deepspeed/runtime/zero/stage3.py, ``pp`` =
partition_parameters.py, ``ppc`` = partitioned_param_coordinator.py (0.19.8),
``po`` = parameter_offload.py (0.19.8), ``cfg`` = deepspeed/runtime/config.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from commsim.ir.errors import CommsimInputError
from commsim.strategies.dsconfig import DeepSpeedConfig
from commsim.strategies.knobs import DEFAULT_PRESET, PRESET_VERSIONS


@dataclass(frozen=True, slots=True)
class DeepSpeedVersion:
    name: str
    # persistent: ds_numel <= threshold (0.19.8 po:325) rather than < (0.5.10 s3:1386,
    # 0.6.0 s3:1388); and stage3_model_persistence_threshold exists (0.19.8 only)
    persistence_inclusive: bool
    model_persistence_cap: bool
    # 0.6.0's prefetch counts every parameter it pops from the queue toward the prefetch
    # budget, available ones too (s3:371-377); 0.19.8 only those it gathers (ppc:457-476)
    prefetch_counts_available: bool
    # 0.19.8 keeps a parameter whose later use the prefetcher already passed (ppc:646-652)
    release_keeps_passed_reuse: bool
    # the release scan stops once more than (0.6.0 s3:458) / at least (0.19.8 ppc:658)
    # max_reuse_distance elements were traversed
    reuse_scan_stops_at_equal: bool
    # bf16 with ZeRO-3 allowed (0.5.10 refuses it: cfg:902)
    zero3_bf16: bool
    # every parameter, persistent ones too, released at the end of each backward (0.5.10
    # s3:2948) rather than at the start of step() (0.6.0 s3:2608; 0.19.8 likewise)
    release_all_after_backward: bool
    # the overflow check runs whatever the dtype (0.5.10 s3:2753, 0.6.0 s3:2611) or for
    # fp16 only (0.19.8 stage3.py:2815)
    overflow_check_always: bool
    # the overflow check's device side: an inf/nan tracker updated per gradient shard as
    # it is stored (0.6.0 s3:2003-2010), or isinf/isnan over the whole gradient partition
    # in step() (0.19.8 stage3.py:3009-3019); the fused_overflow_check knob picks this
    # over 0.5.10's per-parameter host reads
    overflow_tracker_per_gradient: bool
    # a gradient is copied into the bucket when it fits exactly too (0.5.10 s3:1900,
    # 0.19.8 stage3.py:1626) or only with room to spare (0.6.0 s3:1826)
    bucket_takes_exact_fit: bool
    # What DeepSpeed PR 1188 changed (merged between 0.5.4 and 0.5.5), each False from
    # 0.5.5 on. A fetch's demand gathers take the asynchronous per-parameter path
    # (0.5.4 s3:447 calls _all_gather with async_op=True): each parameter into a
    # torch.zeros buffer, torch.cuda.synchronize() before its all-gather, its shard
    # copied in (pp:835-880); 0.5.10 launches them all (_allgather_params_coalesced,
    # pp:918-986) and synchronises once after.
    demand_gather_per_param: bool = False
    # The list all_gather (0.5.4 has no _all_gather_base: pp:875-878, 912-915):
    # ProcessGroupNCCL gathers into a flat buffer of its own and copies each rank's
    # piece out to the list, one copy_ per rank.
    list_all_gather: bool = False
    # A released parameter's data is torch.ones(1).to(device) (pp:728): a pageable
    # host-to-device copy the host waits for, behind the compute stream's queued work;
    # 0.5.10 makes torch.empty(1, device=...) (pp:753).
    release_host_copy: bool = False
    # The synchronous gather (the persistent parameters after the step, pp:884-938):
    # one list all_gather of the parameters' shards, then each parameter copied out of
    # it into a new tensor, one copy_ per rank (the "Python-side copy"); 0.5.10's
    # coalesced path gathers into each parameter's own buffer.
    sync_gather_copies_out: bool = False


VERSIONS: dict[str, DeepSpeedVersion] = {
    # 0.5.4: 0.5.10's ZeRO-3 (the same hooks, PrefetchCoordinator, persistence rule,
    # gradient path and overflow check: stage3.py differs in s3:447 and the optimizer's
    # constructor) but for PR 1188's four changes; its config has no bf16 section
    "0.5.4": DeepSpeedVersion("0.5.4", persistence_inclusive=False, model_persistence_cap=False,
                              prefetch_counts_available=False, release_keeps_passed_reuse=False,
                              reuse_scan_stops_at_equal=False, zero3_bf16=False,
                              release_all_after_backward=True, overflow_check_always=True,
                              overflow_tracker_per_gradient=False, bucket_takes_exact_fit=True,
                              demand_gather_per_param=True, list_all_gather=True, release_host_copy=True,
                              sync_gather_copies_out=True),
    "0.5.10": DeepSpeedVersion("0.5.10", persistence_inclusive=False, model_persistence_cap=False,
                               prefetch_counts_available=False, release_keeps_passed_reuse=False,
                               reuse_scan_stops_at_equal=False, zero3_bf16=False,
                               release_all_after_backward=True, overflow_check_always=True,
                               overflow_tracker_per_gradient=False, bucket_takes_exact_fit=True),
    "0.6.0": DeepSpeedVersion("0.6.0", persistence_inclusive=False, model_persistence_cap=False,
                              prefetch_counts_available=True, release_keeps_passed_reuse=False,
                              reuse_scan_stops_at_equal=False, zero3_bf16=True,
                              release_all_after_backward=False, overflow_check_always=True,
                              overflow_tracker_per_gradient=True, bucket_takes_exact_fit=False),
    "0.19.8": DeepSpeedVersion("0.19.8", persistence_inclusive=True, model_persistence_cap=True,
                               prefetch_counts_available=False, release_keeps_passed_reuse=True,
                               reuse_scan_stops_at_equal=True, zero3_bf16=True,
                               release_all_after_backward=False, overflow_check_always=False,
                               overflow_tracker_per_gradient=False, bucket_takes_exact_fit=True),
}
CURRENT = VERSIONS["0.19.8"]


def version_of(preset: str) -> DeepSpeedVersion:
    """The DeepSpeed release a knob preset models."""
    if preset not in PRESET_VERSIONS:
        raise CommsimInputError(f"--preset {preset!r}: allowed: {', '.join(PRESET_VERSIONS)}")
    return VERSIONS[PRESET_VERSIONS[preset]]


def apply_version_rules(ds: DeepSpeedConfig, version: DeepSpeedVersion) -> tuple[DeepSpeedConfig, list[str]]:
    """The config as ``version`` can run it, with a warning for each change.

    DeepSpeed 0.5.10 refuses bf16 with ZeRO-3 (cfg:902: "bfloat16 mode is only enabled
    for Zero2 currently"), so a 0.5.10 run of a bf16 ZeRO-3 job was an fp16 run, with
    dynamic loss scaling and its overflow check. commsim predicts that run and warns,
    rather than refusing: the question a baseline answers is "what did this job cost
    before the changes", and the seed scenario's bf16 config is commsim's default, not
    the user's choice.
    """
    if ds.zero.stage == 3 and ds.precision == "bf16" and not version.zero3_bf16:
        why = ("refuses bf16 with ZeRO-3 (deepspeed/runtime/config.py:902)" if version.name == "0.5.10"
               else "has no bf16 (its config reads no bf16 section)")
        return replace(ds, precision="fp16"), [
            f"DeepSpeed {version.name} {why}; the {_preset_of(version.name)} runs fp16 (dynamic loss scaling, "
            "per-parameter overflow check) instead"]
    return ds, []


def _preset_of(version: str) -> str:
    """How the warning names the preset running ``version``."""
    preset = next((p for p, v in PRESET_VERSIONS.items() if v == version), version)
    return preset if preset == "baseline" else f"{preset} preset"


__all__ = ["CURRENT", "DEFAULT_PRESET", "DeepSpeedVersion", "VERSIONS", "apply_version_rules", "version_of"]
