"""The settings a scenario takes when it names none: the seed scenario's DeepSpeed and
FSDP2 configs, in the 16-bit type the hardware trains in (bf16, or fp16 on a GPU
without bf16 tensor cores), and the warning for a config that asks for bf16 there."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from commsim.hardware.specs import cluster_preset

if TYPE_CHECKING:
    from commsim.api import Scenario


def default_ds_config(stage: int | None = None, half: str = "bf16") -> dict[str, Any]:
    """The seed scenario's DeepSpeed config: ZeRO-3 (or ``stage``), bf16 (or ``half``:
    "fp16", see ``default_half``), DeepSpeed's own AdamW (an optimizer section, so its
    fused implementation), defaults otherwise."""
    if half not in ("bf16", "fp16"):
        raise ValueError(f"half {half!r}: bf16 or fp16")
    return {half: {"enabled": True}, "optimizer": {"type": "AdamW"},
            "zero_optimization": {"stage": 3 if stage is None else stage}}


def _emulating_gpu(sc: Scenario):
    """The scenario's GPU spec when it only emulates bf16 (no bf16 tensor cores), else
    None; None with a measured profile too (its own tables say what bf16 costs there)."""
    if sc.hw_profile:
        return None
    gpu = cluster_preset(sc.cluster, 1, sc.net, sc.gpus_per_node, sc.nccl_stack).node.gpu
    return gpu if gpu.bf16_gemm_flops_per_s is not None else None


def default_half(sc: Scenario) -> str:
    """The 16-bit type a default config trains in on the scenario's hardware: bf16, but
    fp16 on a GPU without bf16 tensor cores (V100: bf16 matmuls are emulated at about 10
    TFLOPS, published-runs.md G4, so V100 runs of DeepSpeed and FSDP trained in fp16)."""
    return "fp16" if _emulating_gpu(sc) is not None else "bf16"


def bf16_warning(sc: Scenario, precision: str, where: str) -> None:
    """Warn when a config asks for bf16 on a GPU that only emulates it."""
    gpu = _emulating_gpu(sc) if precision == "bf16" else None
    if gpu is not None:
        sc.warnings.append(f"{where} trains in bf16, which {gpu.name} has no tensor cores for: its matmuls "
                           f"are priced at {gpu.bf16_gemm_flops_per_s / 1e12:g} TFLOPS (emulated); training on it "
                           "runs in fp16")


def default_fsdp_config(half: str = "bf16") -> dict[str, Any]:
    """The seed scenario's FSDP2 settings: its bf16 compute (or ``half``), as FSDP2 users
    run it (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, torchtitan's
    default); FSDP2's own defaults otherwise. ``{}`` is FSDP2's defaults, fp32 throughout."""
    if half not in ("bf16", "fp16"):
        raise ValueError(f"half {half!r}: bf16 or fp16")
    return {"mp_param_dtype": half, "mp_reduce_dtype": "fp32"}
