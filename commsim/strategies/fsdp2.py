"""PyTorch FSDP2 (``fully_shard``) lowered to IR, following torch 2.13's hooks through one step.

The model is wrapped the usual way (fsdp2_layout.py: one unit per transformer block,
then the root). What runs, and when, follows torch/distributed/fsdp/_fully_shard/:

* forward (``FSDPState._pre_forward`` / ``_post_forward``): the root's pre-forward
  makes the all-gather streams wait for the compute stream (``_root_pre_forward``);
  each unit's pre-forward all-gathers it (``FSDPParamGroup.unshard``, a no-op when
  already gathered or prefetched) and copies it out (``wait_for_unshard``), then
  issues its explicit forward prefetches (``set_modules_to_forward_prefetch``); the
  all-gather output of a forward copy-out is freed only at the next unit's copy-out, so
  the next copy-in can overlap it ([Note: Overlapping all-gather copy-in and
  all-gather]), the last one at the root's post-forward. Post-forward reshards
  (``reshard``: frees the unsharded parameters; an int ``reshard_after_forward``
  clones a 1/k shard first, ``FSDPParam.to_sharded_post_forward``) unless the unit
  keeps its parameters (``False``, and the root by default), and records the unit in
  the post-forward order;
* backward: the root's pre-backward (on the loss) prefetches the last block
  (``_backward_prefetch``: the previous unit in post-forward order); each block's
  pre-backward gathers it if needed, copies out (freeing the output at once) and
  prefetches the previous block (or its explicit ``set_modules_to_backward_prefetch``
  list); after the block's backward its post-backward reshards, waits for and frees
  the previous reduce-scatter input (``reduce_scatter_states``, one kept in flight),
  and reduces (fsdp2_comm.py). The root's reduce runs in the final callback
  (``_root_post_backward_final_callback``: the root's inputs need no gradient, so no
  post-backward hook fires for it), followed by ``finalize_backward``: the compute
  stream waits for the last reductions, the host for offloaded gradients, and pending
  (prefetched but never used) all-gathers are waited for and dropped;
* activation checkpointing: reentrant (``use_reentrant=True``) runs the blocks'
  forward without grad, so no pre-backward hook is registered then; in backward the
  recompute runs the unit's forward hooks as a forward (it becomes the iteration's
  forward root, copies out with the forward's deferred free, issues its explicit
  forward prefetches, which may gather blocks already reduced), then the pre-backward
  hook of the recomputed output fires. Non-reentrant: the pre-backward hook fires
  first, and the recompute's forward hooks see PRE_BACKWARD and do nothing;
* gradient accumulation: ``set_requires_gradient_sync(False)`` skips the reduction
  (post-backward reshards and, with a reduce dtype other than the compute dtype, keeps
  the unsharded gradient in the reduce dtype, ``to_accumulated_grad_if_needed``), later
  micro-steps add into it; with sync every micro-step the new sharded gradient is
  added into the last one's;
* the optimizer: torch's AdamW on this rank's unpadded rows, fp32 (optimizer.py:
  foreach on GPUs; on CPUs single-tensor, each parameter's passes in turn, stating the
  bytes they reuse), or on the host with CPU offload; ``zero_grad`` frees the gradients.

Each rank's Python issues everything in that order; kernels run on the compute stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from commsim.ir import ops as O
from commsim.ir.ops import Phase
from commsim.models.spec import ModelDescription
from commsim.strategies.activations import Activations
from commsim.strategies.builder import ProgramBuilder
from commsim.strategies.fsdp2_comm import (AG_STREAMS, COMPUTE, COPY_IN, DTYPES, REDUCE_SCATTER, Comm, Gathered,
                                           Reduced, Streams)
from commsim.strategies.fsdp2_config import FSDP2Config
from commsim.strategies.fsdp2_kernels import FSDP2Kernels
from commsim.strategies.fsdp2_layout import FSDP2Layout, Unit, local_numel
from commsim.strategies.knobs import HostCosts
from commsim.strategies.optimizer import CPU_ADAM_BYTES, TORCH_ADAMW_BYTES, torch_adamw
from commsim.strategies.zero3_trace import CHECKPOINT_STYLES

SHARDED, POST_FORWARD, UNSHARDED = "sharded", "sharded_post_forward", "unsharded"  # ShardedState
IDLE, FORWARD, PRE_BACKWARD, POST_BACKWARD = "idle", "forward", "pre_backward", "post_backward"  # TrainingState


@dataclass
class _Group:
    """One unit's ``FSDPParamGroup`` state."""

    unit: Unit
    state: str = SHARDED
    training: str = IDLE
    gathered: Gathered | None = None  # _all_gather_result
    reshard_event: O.OpId | None = None  # _reshard_after_forward_event
    post_forward_indices: list[int] = field(default_factory=list)
    ugrads: set[str] = field(default_factory=set)  # unsharded gradients alive (compute dtype)
    accumulated: bool = False  # unsharded_accumulated_grad (reduce dtype) alive
    grad: str | None = None  # the sharded gradient (until zero_grad)
    grad_stream: str = COMPUTE
    ar_hold: str | None = None  # _all_reduce_state
    offload_events: list[O.OpId] = field(default_factory=list)
    forward_prefetch: list["_Group"] = field(default_factory=list)
    backward_prefetch: list["_Group"] = field(default_factory=list)


class FSDP2Lowering(FSDP2Kernels):
    """One rank's FSDP2 step. One instance lowers one step."""

    def __init__(self, md: ModelDescription, world_size: int, cfg: FSDP2Config, costs: HostCosts,
                 checkpointing: bool, checkpoint_style: str = "reentrant", foreach: bool = True,
                 host_blocking: bool = False):
        assert checkpoint_style in CHECKPOINT_STYLES, checkpoint_style
        self.md, self.cfg, self.costs = md, cfg, costs
        self.param_names: dict[str, tuple[str, ...]] = {}  # module path -> its parameters' buffers (_params_of)
        self.foreach = foreach  # torch's AdamW default: foreach on GPUs, single-tensor on CPUs
        self.checkpointing, self.style = checkpointing, checkpoint_style
        self.layout = FSDP2Layout.build(md, world_size, cfg)
        lay = self.layout
        post = {u.post_forward for u in lay.units if u.post_forward is not None and u.post_forward < lay.shard}
        self.post_forward_group = min(post) if post else None
        self.groups_of = lambda r: lay.groups_of(r, self.post_forward_group)
        g0 = self.groups_of(0)
        self.shard_group, self.pf_group, self.replica_group = g0.partition, g0.secondary, g0.replica
        self.b = ProgramBuilder()
        self.streams = Streams(self.b)
        self.comm = Comm(self.b, self.streams, costs, lay.shard, cfg.param_dtype, cfg.reduce_dtype, cfg.orig_dtype,
                         cfg.offload, cfg.offload_pin_memory)
        self.b.host_blocking = host_blocking
        self.gdt = DTYPES[cfg.param_dtype]  # gradients are computed in the compute dtype
        self.groups = [_Group(u) for u in lay.units]
        self.by_unit = {id(g.unit): g for g in self.groups}
        blocks = self.groups[:-1]
        for i, g in enumerate(blocks):  # runtime/examples/fsdp_train.py sets them this way
            g.forward_prefetch = blocks[i + 1:i + 1 + cfg.forward_prefetch]
            g.backward_prefetch = blocks[max(0, i - cfg.backward_prefetch):i][::-1] if cfg.backward_prefetch else []
        self.acts = Activations(self.b, md, COMPUTE, self.checkpointing)
        # FSDPCommContext / FSDPStateContext
        self.all_gather_state: tuple[str, O.OpId] | None = None
        self.post_forward_order: list[_Group] = []
        self.rs_states: list[tuple[str, O.OpId]] = []
        self.last_post_reduce: dict[str, O.OpId] = {}
        self.iter_forward_root: _Group | None = None
        self.mb = ""
        self.reduce_grads = True
        self.numel = {p.name: p.numel for p in md.unique_params()}
        self.seen_grads: set[str] = set()  # parameters whose gradient this backward has written

    @property
    def root(self) -> _Group:
        return self.groups[-1]

    # ------------------------------------------------------------ the step
    def program(self):
        b, cfg = self.b, self.cfg
        assert not b.setup and not b.step, "an FSDP2Lowering lowers one step; make a new one for another"
        self._setup()
        gas = cfg.gradient_accumulation_steps
        for micro in range(gas):
            self.mb = f"mb{micro}." if gas > 1 else ""
            self.reduce_grads = cfg.requires_gradient_sync or micro == gas - 1
            self._forward()
            self._backward()
        self._optimizer()
        return b.program()

    def _setup(self) -> None:
        if self.cfg.offload:  # sharded parameters, gradients and AdamW state live in host memory
            return
        for u in self.layout.units:
            self.b.setup_alloc(self._shard_buffer(u), u.shard(self.layout.shard) * 4,
                               f"sharded fp32 parameters of {u.name}")
        n = sum(u.local for u in self.layout.units)
        for state in ("exp_avg", "exp_avg_sq"):
            self.b.setup_alloc(state, n * 4, f"AdamW {state} (this rank's rows)")

    def _shard_buffer(self, u: Unit) -> str:
        return f"shard:{u.name}"

    # ------------------------------------------------------------ passes
    def _forward(self) -> None:
        self.b.phase = Phase.FORWARD
        root = self.root
        self._pre_forward(root)
        for u, modules in self.layout.segments:
            g = self.by_unit[id(u)]
            if g is root:
                self._kernels(g, modules, Phase.FORWARD)
                continue
            self._pre_forward(g)
            self._kernels(g, modules, Phase.FORWARD)
            self._post_forward(g, in_backward=False)
        self._post_forward(root, in_backward=False)

    def _backward(self) -> None:
        b = self.b
        b.phase = Phase.BACKWARD
        self.seen_grads = set()
        root = self.root
        self._pre_backward(root)
        for u, modules in reversed(self.layout.segments):
            g = self.by_unit[id(u)]
            if g is root:
                self._kernels(g, tuple(reversed(modules)), Phase.BACKWARD)
                continue
            if self.checkpointing and self.style == "reentrant":
                b.phase = Phase.RECOMPUTE
                self._pre_forward(g)
                self._kernels(g, modules, Phase.RECOMPUTE)
                self._post_forward(g, in_backward=True)
                b.phase = Phase.BACKWARD
                self._pre_backward(g)
            elif self.checkpointing:
                self._pre_backward(g)
                b.phase = Phase.RECOMPUTE
                # the recompute's hooks see PRE_BACKWARD: the unit is already gathered
                self._hook(f"pre_forward {g.unit.name} (recompute)")
                self._kernels(g, modules, Phase.RECOMPUTE)
                self._hook(f"post_forward {g.unit.name} (recompute)")
                b.phase = Phase.BACKWARD
            else:
                self._pre_backward(g)
            self._kernels(g, tuple(reversed(modules)), Phase.BACKWARD)
            self._post_backward(g)
        self.acts.end_backward()
        self._final_callback()

    # ------------------------------------------------------------ hooks (FSDPState / FSDPParamGroup)
    def _hook(self, what: str) -> None:
        self.b.host(f"FSDP {what}", O.HostKind.MODULE_HOOK, self.costs.fsdp2_hook_ns)

    def _pre_forward(self, g: _Group) -> None:
        self._hook(f"pre_forward {g.unit.name}")
        if self.iter_forward_root is None:  # _root_pre_forward: wait for the optimizer / backward
            self.iter_forward_root = g
            for s in AG_STREAMS:
                self.streams.wait_stream(s, COMPUTE)
        g.training = FORWARD
        self._unshard(g)
        self._wait_for_unshard(g)
        for t in g.forward_prefetch:
            self._unshard(t)

    def _post_forward(self, g: _Group, in_backward: bool) -> None:
        self._hook(f"post_forward {g.unit.name}")
        if not in_backward:  # is_bw(): a recompute neither reshards nor records
            self._reshard(g)
            self.post_forward_order.append(g)
            g.post_forward_indices.append(len(self.post_forward_order) - 1)
        g.training = IDLE
        if self.iter_forward_root is g:
            self._free_all_gather_state()
            self.iter_forward_root = None

    def _pre_backward(self, g: _Group) -> None:
        self._hook(f"pre_backward {g.unit.name}")
        if g.training == PRE_BACKWARD:
            return
        g.training = PRE_BACKWARD
        self._unshard(g)
        self._wait_for_unshard(g)
        if not g.backward_prefetch:  # default_prefetch
            if g.post_forward_indices:
                i = g.post_forward_indices.pop()
                if i > 0:
                    self._unshard(self.post_forward_order[i - 1])
        for t in g.backward_prefetch:
            self._unshard(t)

    def _post_backward(self, g: _Group) -> None:
        b, u = self.b, g.unit
        self._hook(f"post_backward {u.name}")
        g.training = POST_BACKWARD
        grads = tuple(f"ugrad:{n}" for n in sorted(g.ugrads))
        if g.accumulated and grads:  # accumulate_unsharded_grad_if_needed
            self._elementwise(f"{self.mb}{u.name}.accumulate_unsharded", u.numel,
                              u.numel * (self.comm.rdt.itemsize_bytes + self.gdt.itemsize_bytes),
                              u.numel * self.comm.rdt.itemsize_bytes, (f"uacc:{u.name}",) + grads)
            self._free_ugrads(g)
        if not self.reduce_grads:
            self._reshard(g)
            if self.comm.rdt is not self.gdt and g.ugrads:  # to_accumulated_grad_if_needed
                b.alloc(f"uacc:{u.name}", u.numel * self.comm.rdt.itemsize_bytes, COMPUTE,
                        f"unsharded gradient of {u.name} in the reduce dtype")
                self._elementwise(f"{self.mb}{u.name}.to_reduce_dtype", u.numel,
                                  u.numel * self.gdt.itemsize_bytes, u.numel * self.comm.rdt.itemsize_bytes,
                                  (f"uacc:{u.name}",) + tuple(f"ugrad:{n}" for n in sorted(g.ugrads)))
                self._free_ugrads(g)
                g.accumulated = True
            return
        if g.accumulated:
            grads, gdt = (f"uacc:{u.name}",), self.comm.rdt
        else:
            grads, gdt = tuple(f"ugrad:{n}" for n in sorted(g.ugrads)), self.gdt
        self._reshard(g)
        if self.rs_states:  # keep one reduce-scatter input in flight
            buf, event = self.rs_states.pop(0)
            self.streams.wait_event(COMPUTE, event)
            b.free(buf, COMPUTE, "reduce-scatter input (recycled)")
        g.ugrads.clear()
        g.accumulated = False
        r: Reduced = self.comm.reduce(u, grads, gdt, self.shard_group, self.replica_group, g.grad,
                                      f"{self.mb}bwd.rs:{u.name}")
        self.last_post_reduce[r.post_stream] = r.post_event
        self.rs_states.append((r.rs_input, r.rs_event))
        if r.grad is not None:
            g.grad, g.grad_stream = r.grad, r.post_stream if r.grad.startswith("grad32") else REDUCE_SCATTER
        if r.ar_hold is not None:
            if g.ar_hold is not None:
                b.free(g.ar_hold, REDUCE_SCATTER, "reduce-dtype all-reduce buffer")
            g.ar_hold = r.ar_hold
        g.offload_events.extend(r.offload_events)

    def _final_callback(self) -> None:
        b = self.b
        self._hook("root_post_backward_final_callback")
        for g in [self.root] + self.groups[:-1]:  # all_states: named_modules() pre-order
            if g.training != POST_BACKWARD:
                self._post_backward(g)
            g.training = IDLE
            # finalize_backward
            for stream in list(self.last_post_reduce):
                self.streams.wait_event(COMPUTE, self.last_post_reduce.pop(stream))
            if g.ar_hold is not None:
                b.free(g.ar_hold, REDUCE_SCATTER, "reduce-dtype all-reduce buffer")
                g.ar_hold = None
            if g.offload_events:
                b.sync_ops(tuple(g.offload_events), f"gradients of {g.unit.name} on the host")
                g.offload_events.clear()
            if g.gathered is not None:  # prefetched and never waited for
                self.streams.wait_event(COMPUTE, g.gathered.op)
                b.free(g.gathered.buffer, COPY_IN, "all-gather output (prefetched, unused)")
                g.gathered = None
            g.post_forward_indices.clear()
        self.post_forward_order.clear()
        for buf, event in self.rs_states:
            self.streams.wait_event(COMPUTE, event)
        for buf, _ in self.rs_states:
            b.free(buf, COMPUTE, "reduce-scatter input")
        self.rs_states.clear()

    # ------------------------------------------------------------ unshard / reshard (FSDPParamGroup)
    def _unshard(self, g: _Group) -> None:
        if g.gathered is not None or g.state == UNSHARDED:
            return
        if g.reshard_event is not None:
            self.streams.wait_event(AG_STREAMS, g.reshard_event)
            g.reshard_event = None
        u = g.unit
        if g.state == POST_FORWARD:
            source, group = f"pf:{u.name}", self.pf_group
        else:
            source, group = (None if self.cfg.offload else self._shard_buffer(u)), self.shard_group
        assert group is not None
        g.gathered = self.comm.all_gather(u, source, group, f"{self.mb}{self.b.phase.value}.ag:{u.name}")

    def _wait_for_unshard(self, g: _Group) -> None:
        if g.gathered is None:
            return
        if g.training == FORWARD:
            self._free_all_gather_state()
        u = g.unit
        copy = self.comm.copy_out(u, g.gathered, f"{self.mb}{self.b.phase.value}.ag:{u.name}")
        if g.state == POST_FORWARD:  # to_unsharded drops the post-forward shard
            self.b.free(f"pf:{u.name}", COMPUTE, f"post-forward shard of {u.name}")
        g.state = UNSHARDED
        if g.training == FORWARD:  # freed after the next copy-out
            self.all_gather_state = (g.gathered.buffer, copy)
        else:
            self.streams.wait_event(AG_STREAMS, copy)
            self.b.free(g.gathered.buffer, COPY_IN, f"all-gather output of {u.name}")
        g.gathered = None

    def _free_all_gather_state(self) -> None:
        if self.all_gather_state is not None:
            buf, copy = self.all_gather_state
            self.streams.wait_event(AG_STREAMS, copy)
            self.b.free(buf, COPY_IN, "all-gather output (previous unit)")
            self.all_gather_state = None

    def _reshard(self, g: _Group) -> None:
        b, u = self.b, g.unit
        if g.training == FORWARD:
            if u.post_forward is None:
                return
            if u.post_forward < self.layout.shard:  # to_sharded_post_forward: keep a 1/k clone
                k = u.post_forward
                b.alloc(f"pf:{u.name}", u.padded // k * self.comm.pdt.itemsize_bytes, COMPUTE,
                        f"post-forward shard of {u.name} over {k} ranks")
                b.host("launch", O.HostKind.LAUNCH, self.costs.launch_ns)
                g.reshard_event = b.copy(COMPUTE, f"{self.mb}fwd.reshard:{u.name}", O.CopyDirection.D2D,
                                         u.padded // k * self.comm.pdt.itemsize_bytes,
                                         deps=self.streams.deps(COMPUTE), buffers=self._params(u) + (f"pf:{u.name}",))
                self._free_params(u)
                g.state = POST_FORWARD
                return
        if g.state == UNSHARDED:
            self._free_params(u)
        assert g.state != POST_FORWARD, f"{u.name} resharded after backward without being gathered"
        g.state = SHARDED

    def _params(self, u: Unit) -> tuple[str, ...]:
        return tuple(f"param:{p.name}" for p in u.params)

    def _free_params(self, u: Unit) -> None:
        for p in u.params:
            self.b.free(f"param:{p.name}", COMPUTE, f"unsharded {p.name} (resharded)")

    def _free_ugrads(self, g: _Group) -> None:
        for n in sorted(g.ugrads):
            self.b.free(f"ugrad:{n}", COMPUTE, f"unsharded gradient of {n}")
        g.ugrads.clear()

    # ------------------------------------------------------------ optimizer
    def _optimizer(self) -> None:
        b, c = self.b, self.costs
        b.phase = Phase.OPTIMIZER
        n = sum(u.local for u in self.layout.units)
        if self.cfg.offload:
            # torch's AdamW on the host's fp32 rows, at the host bandwidth that prices CPU Adam
            b.host("optimizer.adamw (host)", O.HostKind.OPTIMIZER,
                   n * c.cpu_adam_ps_per_param * TORCH_ADAMW_BYTES // CPU_ADAM_BYTES // 1000)
        else:
            state = tuple(self._shard_buffer(u) for u in self.layout.units) + ("exp_avg", "exp_avg_sq") + \
                tuple(g.grad for g in self.groups if g.grad)
            params = [(p.name, local_numel(p, self.layout.shard)) for u in self.layout.units for p in u.params]
            torch_adamw(b, COMPUTE, "optimizer.adamw", params, state, c.launch_ns, self.foreach, c.dtensor_op_ns,
                        deps=self.streams.deps(COMPUTE))
        for g in self.groups:  # zero_grad(set_to_none=True)
            if g.grad is not None:
                b.free(g.grad, g.grad_stream, f"sharded gradient of {g.unit.name}")
                g.grad = None
