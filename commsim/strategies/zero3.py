"""ZeRO stage 3 lowered to IR, following DeepSpeed's engine through one training step.

Models the steady state (the parameter trace is complete, so prefetching is on) of
deepspeed/runtime/zero/ (0.19.x, as summarised in reference/deepspeed-zero3.md, and
the releases of the seed story, 0.5.10 and 0.6.0: dsversions.py, knobs.py), in parts
that each model one piece of DeepSpeed:

* zero3_trace.py: the order in which the module hooks fire (forward, recompute of
  checkpointed layers, backward);
* zero3_params.py: the parameter coordinator (partitioned_param_coordinator.py):
  fetch, prefetch, release, persistence, the all-gathers (coalesced, hpZ, MiCS);
* zero3_grads.py: the gradient hooks, bucket and reduce-scatters (stage3.py);
* zero3_optimizer.py: the partitioned optimizer state and the step (stage3.py);
* zero3_layout.py: the partitioning they all read.

``Zero3Lowering`` here is the driver, playing the engine's part: it makes the parts,
emits the setup state, and for each micro-step walks the trace: a hook call fetches
through the coordinator, the module's kernels run on the compute stream (with its
activations and, in backward, its gradients), its post hook releases; at the end of
backward the reducer's epilogue runs, and after the last micro-step the optimizer
step. Activations (what each module keeps, checkpointed layer inputs, and the
activation gradients of backward) are ``activations.Activations``.

Every gathered parameter, flat buffer, gradient, bucket and activation is an
alloc / free with its real size, so the allocator model sees DeepSpeed's pattern.
"""

from __future__ import annotations

from commsim.ir import ops as O
from commsim.ir.errors import CommsimInputError
from commsim.ir.ops import Phase
from commsim.models.spec import Kernel, ModelDescription
from commsim.strategies.activations import Activations
from commsim.strategies.builder import ProgramBuilder
from commsim.strategies.dsconfig import DeepSpeedConfig
from commsim.strategies.dsversions import CURRENT, DeepSpeedVersion
from commsim.strategies.groups import check_hierarchy, rank_groups
from commsim.strategies.knobs import HostCosts, Knobs
from commsim.strategies.zero3_grads import GradReducer
from commsim.strategies.zero3_layout import COMPUTE, Zero3Layout
from commsim.strategies.zero3_optimizer import Zero3OptimizerStep
from commsim.strategies.zero3_params import ParamCoordinator
from commsim.strategies.zero3_trace import CHECKPOINT_STYLES, TraceEntry, module_trace

_DTYPES = {"bf16": O.DType.BF16, "fp16": O.DType.FP16, "fp32": O.DType.FP32}


class Zero3Lowering:
    """One rank's program (all ranks are symmetric in plain ZeRO-3). One instance
    lowers one step."""

    def __init__(self, md: ModelDescription, world_size: int, ds: DeepSpeedConfig, knobs: Knobs,
                 costs: HostCosts, checkpointing: bool, grad_accum: int, checkpoint_style: str = "reentrant",
                 gpus_per_node: int | None = None, version: DeepSpeedVersion = CURRENT):
        z = ds.zero
        if z.offload_param.device != "none" or z.offload_optimizer.device not in ("none", "cpu"):
            raise CommsimInputError("ds_config: zero_optimization: only offload_optimizer to cpu is modelled")
        gpn = gpus_per_node or world_size
        hpz = z.zero_hpz_partition_size if z.zero_hpz_partition_size > 1 else 1
        check_hierarchy(world_size, gpn, hpz, z.mics_shard_size, ds.source,
                        hierarchical=z.mics_hierarchical_params_gather)
        self.md, self.costs, self.version = md, costs, version
        self.checkpointing, self.grad_accum = checkpointing, grad_accum
        # each rank's groups: generate() relabels rank 0's program with them
        self.groups_of = lambda r: rank_groups(r, world_size, gpn, hpz, z.mics_shard_size,
                                               z.mics_hierarchical_params_gather)
        self.b = ProgramBuilder()
        self.layout = Zero3Layout.build(md.registered_params(), self.groups_of(0), ds.param_dtype_bytes,
                                        _DTYPES[ds.precision], z.overlap_comm,
                                        z.offload_optimizer.device == "cpu", hpz)
        self.trace = module_trace(md, checkpointing, checkpoint_style)
        self.coord = ParamCoordinator(self.b, self.layout, z, knobs, costs, self.trace, version)
        self.optimizer = Zero3OptimizerStep(self.b, self.layout, ds, knobs, costs, self.coord, version)
        self.grads = GradReducer(self.b, self.layout, z, knobs, costs, self.trace, version,
                                 self.optimizer.sub_group_elems())
        self.acts = Activations(self.b, md, COMPUTE, checkpointing)

    def program(self):
        b = self.b
        assert not b.setup and not b.step, "a Zero3Lowering lowers one step; make a new one for another"
        # setup order: optimizer partitions, gradient bucket, persistent parameters
        self.optimizer.emit_setup()
        self.grads.emit_setup()
        self.coord.emit_setup()
        for micro in range(self.grad_accum):
            mb = f"mb{micro}." if self.grad_accum > 1 else ""
            self.coord.reset_micro_step()
            self.grads.reset_micro_step(at_boundary=micro == self.grad_accum - 1)
            in_backward = False
            for i, e in enumerate(self.trace):
                b.phase = e.phase
                if e.phase is not Phase.FORWARD and not in_backward:
                    in_backward = True  # engine.backward: the optimizer's backward() begins
                    self.grads.begin_backward()
                deps = self.coord.fetch(i, e) if e.fetch else ()
                if e.run:
                    self._run_module(mb, e, deps)
                if e.release:
                    self.coord.release(i + 1, e)
            self.acts.end_backward()
            if self.version.release_all_after_backward:
                self.coord.release_all()  # 0.5.10 s3:2948, before the epilogue
            self.grads.epilogue()
        self.optimizer.step()
        return b.program()

    # ------------------------------------------------------------ compute
    def _kernels(self, e: TraceEntry) -> tuple[Kernel, ...]:
        return e.module.bwd if e.phase is Phase.BACKWARD else e.module.fwd

    def _run_module(self, mb: str, e: TraceEntry, deps: tuple[O.OpId, ...]) -> None:
        b, m = self.b, e.module
        pbufs = tuple(dict.fromkeys(self.coord.pbuf(p) for p in m.params))
        backward = e.phase is Phase.BACKWARD and bool(m.bwd)
        grads = self.grads.before_backward(m) if backward else ()
        act = self.acts.before(mb, m, e.phase)
        if self._kernels(e) and m.syncs_before(e.phase):
            b.sync_stream(COMPUTE, f"{mb}{m.path}.{e.phase.value} stream synchronize")
        for j, k in enumerate(self._kernels(e)):
            b.host("launch", O.HostKind.LAUNCH, self.costs.launch_ns)
            suffix = "" if k.name in ("fwd", "bwd") else f".{k.name}"
            b.compute(COMPUTE, f"{mb}{m.path}.{e.phase.value}{suffix}", k.kind, k.flops, k.bytes_read, k.bytes_written,
                      k.gemm, deps=deps if j == 0 else (), buffers=pbufs + grads + act)
        self.acts.after(mb, m, e.phase)
        if backward:
            self.grads.after_backward(m)


# the trace's names, imported from here by older code
__all__ = ["CHECKPOINT_STYLES", "TraceEntry", "Zero3Lowering", "module_trace"]
