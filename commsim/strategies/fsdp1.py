"""PyTorch FSDP1 (``FullyShardedDataParallel``) lowered to IR, following torch 2.13's hooks through one step.

The model is wrapped the usual way (fsdp1_config.py): one unit per transformer block,
then the root. Each unit's parameters form one flat parameter of N elements, padded to
P = ceil(N / S) S over the shard group of S ranks; a rank keeps S_u = P / S of them in
fp32. References are to torch/distributed/fsdp/ in torch 2.13: RU = _runtime_utils.py,
FP = _flat_param.py, LU = _limiter_utils.py.

* streams (RU:237-273): all-gathers on ``unshard``, the mixed-precision casts of the
  shards on ``pre_unshard``, reduce-scatters on ``post_backward``, HSDP's all-reduce on
  ``all_reduce``; compute on the default stream. The root's pre-forward makes the side
  streams wait for the default one (RU:504-606);
* unshard (RU:276-306): with mixed precision the shard is cast on ``pre_unshard`` and
  ``unshard`` waits for it; then the rate limiter (``limit_all_gathers``, LU: the host
  blocks on the oldest free event once two are queued); then, unless the flat parameter
  is already unsharded, its padded full buffer is allocated on ``unshard`` and one
  all-gather of P elements in the compute dtype fills it (FP:1440-1480); the cast shard
  is freed. The default stream waits for ``unshard`` before the unit's kernels
  (RU:411-434);
* reshard: after forward for a non-root unit under FULL_SHARD / HYBRID_SHARD
  (RU:486-501), and in every unit's post-backward (RU:793-827), the full buffer is freed
  (reusable once the default stream has passed, ``_no_dispatch_record_stream``) and a
  free event recorded on the default stream joins the limiter's queue (RU:310-330). The
  queue lives across steps: the step starts with the previous step's events in it;
* backward: the root's pre-backward hook fires first, then each block's, last to first
  (RU:629-696): unshard (unless prefetched), the default stream waits, and with
  BACKWARD_PRE the unit before it in post-forward order is unsharded ahead
  (``_prefetch_handle``). The unit's gradient kernels end with ``cat`` of its
  parameters' gradients into an N-element flat gradient. Its post-backward hook
  (RU:699-774, ``_reduce_grad`` RU:830-886): reshard (BACKWARD_POST prefetches here),
  ``post_backward`` waits for the default stream, casts the gradient to the reduce dtype
  if it differs, pads it to P if P > N, divides by the pre-divide factor, reduce-scatters
  P elements into a new S_u-element shard; HSDP all-reduces that over the replicas on
  ``all_reduce``; the post-divide; a cast to fp32 when the reduce dtype is not; the flat
  gradient is freed. The final callback makes the default stream wait for the reduction
  streams (RU:1082-1126);
* forward prefetch (``forward_prefetch``): the root's pre-forward marks every unit to
  be unsharded; each unit's pre-forward, after its own wait, unshards the next unit of
  the first iteration's pre-forward order (RU:411-434, RU:1207-1289). That gather also
  makes the next unit's views, so in backward autograd, which runs the latest-created
  ready node first, reaches the unit's flat gradient (its ``cat``, then the
  post-backward hook) only after the next unit's backward kernels (recorded on gloo; a
  reentrant recompute makes the views again, in its own pre-forward);
* activation checkpointing as Hugging Face places it, around each block's call outside
  its unit: reentrant runs the block's forward without grad, so no backward hooks are
  registered; the recompute in backward is a full forward of the unit (unshard, reshard
  and free) before its pre-backward hook unshards it again, and no unit is prefetched in
  backward (RU:1272-1279: the target's ``_needs_pre_backward_unshard`` is still False).
  Non-reentrant: the pre-backward hook fires first and the recompute's hooks return at
  once (RU:375-380);
* NO_SHARD: each flat parameter whole on every rank, nothing gathered or enqueued; with
  mixed precision a low-precision copy is made on ``pre_unshard`` at every pre-forward
  and pre-backward and freed at every reshard (FP:1784-1803); each unit's gradient is
  all-reduced over every rank in place (fsdp1_grads.py) and kept whole as ``.grad``;
* gradient accumulation: the optimizer runs after the last micro-step. Without
  ``no_sync`` each micro-step reduces; from the second on the new fp32 shard is added
  into the kept one (``_accumulate_sharded_grad``, RU:906-928) and freed. Inside
  ``no_sync()`` nothing is reduced: the flat gradient stays as the flat parameter's
  ``.grad`` and the next micro-step's is added into it (AccumulateGrad) and freed; the
  final callback does not wait for the reduction streams (RU:1099-1105); SHARD_GRAD_OP
  keeps its gathered parameters through it (``_should_free_in_backward``, RU:795-812),
  so the next micro-step gathers nothing. The last micro-step reduces what accumulated;
* the optimizer: torch's AdamW on the rank's fp32 flat shards (foreach on GPUs), then
  ``zero_grad`` frees the sharded gradients.

The collective order of each setting was recorded from real FSDP1 on gloo ranks
(tests/runtime/test_fsdp1_fidelity.py). Each hook call (the root's pre-forward, each
unit's pre-forward, post-forward, pre-backward and post-backward, the final callback) is
charged ``HostCosts.fsdp1_hook_ns``, FSDP1's own Python timed by difference
(runtime/fsdp1_host_costs.py) beside the kernels and collectives priced here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import ceil

from commsim.ir import ops as O
from commsim.ir.ops import Phase
from commsim.models.spec import ModelDescription, ModuleSpec
from commsim.strategies.activations import Activations
from commsim.strategies.builder import ProgramBuilder
from commsim.strategies.fsdp1_config import FSDP1Config
from commsim.strategies.fsdp1_grads import ALL_REDUCE, COMPUTE, FP32, POST_BACKWARD, FSDP1Gradients
from commsim.strategies.fsdp2_comm import DTYPES, Streams
from commsim.strategies.fsdp2_config import FSDP2Config
from commsim.strategies.fsdp2_kernels import FSDP2Kernels
from commsim.strategies.fsdp2_layout import FSDP2Layout, Unit
from commsim.strategies.knobs import HostCosts
from commsim.strategies.zero3_trace import CHECKPOINT_STYLES

UNSHARD, PRE_UNSHARD = "unshard", "pre_unshard"


@dataclass
class _Handle:
    """One unit's ``FlatParamHandle`` state."""

    unit: Unit
    shard: int  # S_u: elements per rank
    padded: int  # P_u = S_u x S
    unsharded: bool = False
    prefetched: bool = False
    needs_pre_backward: bool = False  # _needs_pre_backward_unshard: hooks on its outputs, not yet fired
    post_forward_index: int | None = None  # _post_forward_index (_exec_order_utils.py:130-148)
    forward_grad: bool = True  # its last forward recorded autograd (no: under reentrant checkpointing)
    ugrads: set[str] = field(default_factory=set)
    grad: str | None = None  # the sharded gradient (``_saved_grad_shard``, then ``.grad``)
    grad_stream: str = POST_BACKWARD
    acc: str | None = None  # the unsharded gradient kept under no_sync (the flat parameter's ``.grad``)
    needs_pre_forward: bool = False  # _needs_pre_forward_unshard (forward_prefetch only)
    views_early: bool = False  # the views autograd recorded came from a forward prefetch

    @property
    def name(self) -> str:
        return self.unit.name

    @property
    def full(self) -> str:
        return f"flat:{self.unit.name}"


class FSDP1Lowering(FSDP2Kernels, FSDP1Gradients):
    """One rank's FSDP1 step. ``stale``: free events already in the limiter's queue at
    the step's start (the previous step's, long complete)."""

    def __init__(self, md: ModelDescription, world_size: int, gpus_per_node: int, cfg: FSDP1Config,
                 costs: HostCosts, checkpointing: bool, checkpoint_style: str = "reentrant", foreach: bool = True,
                 host_blocking: bool = False, stale: int = 0):
        assert checkpoint_style in CHECKPOINT_STYLES, checkpoint_style
        self.md, self.cfg, self.costs = md, cfg, costs
        self.checkpointing, self.style, self.foreach = checkpointing, checkpoint_style, foreach
        s = cfg.shard_size(world_size, gpus_per_node)
        self.no_shard = s == 1  # NO_SHARD: the units' groups are the world's, for the all-reduce
        replicas = 1 if self.no_shard else world_size // s
        self.layout = FSDP2Layout.build(md, world_size, FSDP2Config(hsdp_replicas=replicas))
        self.groups_of = lambda r: self.layout.groups_of(r, None)
        g0 = self.groups_of(0)
        self.shard_group, self.replica_group = g0.partition, g0.replica
        self.world = world_size
        self.b = ProgramBuilder()
        self.b.host_blocking = host_blocking
        self.streams = Streams(self.b)
        self.cdt, self.rdt = DTYPES[cfg.param_dtype], DTYPES[cfg.reduce_dtype]
        self.gdt = self.cdt  # the kernels' gradients: compute dtype
        # NO_SHARD: every flat parameter whole and unpadded, never gathered
        self.handles = [_Handle(u, ceil(u.numel / s), ceil(u.numel / s) * s, unsharded=self.no_shard)
                        for u in self.layout.units]
        self.by_unit = {id(h.unit): h for h in self.handles}
        self.unit_of_param = {p.name: h for h in self.handles for p in h.unit.params}
        self.acts = Activations(self.b, md, COMPUTE, checkpointing)
        self.queue: list[O.OpId | None] = [None] * stale  # _FreeEventQueue
        self.post_forward_order: list[_Handle] = []
        order = {id(h): h for h in [self.root] + [self.by_unit[id(u)] for u, _ in self.layout.segments]}
        self.pre_forward_order = list(order.values())  # the first iteration's (_exec_order_utils.py:150-170)
        self.mb = ""
        self.sync = True  # this micro-step reduces (not inside no_sync)
        self.param_names: dict[str, tuple[str, ...]] = {}
        self.numel = {p.name: p.numel for p in md.unique_params()}
        self.seen_grads: set[str] = set()

    @property
    def root(self) -> _Handle:
        return self.handles[-1]

    # ------------------------------------------------------------ the step
    def program(self):
        b = self.b
        assert not b.setup and not b.step, "an FSDP1Lowering lowers one step; make a new one for another"
        for h in self.handles:
            b.setup_alloc(f"shard:{h.name}", h.shard * 4, f"sharded fp32 flat parameter of {h.name}")
        n = sum(h.shard for h in self.handles)
        for state in ("exp_avg", "exp_avg_sq"):
            b.setup_alloc(state, n * 4, f"AdamW {state} (this rank's flat shards)")
        gas = self.cfg.gradient_accumulation_steps
        for micro in range(gas):
            self.mb = f"mb{micro}." if gas > 1 else ""
            self.sync = not self.cfg.no_sync or micro == gas - 1
            self._forward()
            self._backward()
        self._optimizer()
        return b.program()

    def _forward(self) -> None:
        self.b.phase = Phase.FORWARD
        root = self.root
        self._hook("root pre-forward")
        if self.cfg.forward_prefetch:  # _root_pre_forward (RU:580-588)
            for h in self.handles:
                h.needs_pre_forward, h.prefetched = True, False
        for s in (UNSHARD, PRE_UNSHARD):  # _root_pre_forward: the side streams wait for the default one
            self.streams.wait_stream(s, COMPUTE)
        self._pre_forward(root, grad=True)
        for u, modules in self.layout.segments:
            h = self.by_unit[id(u)]
            if h is root:
                self._kernels(h, modules, Phase.FORWARD)
                continue
            # reentrant checkpointing runs the block without grad: no backward hooks
            self._pre_forward(h, grad=not (self.checkpointing and self.style == "reentrant"))
            self._kernels(h, modules, Phase.FORWARD)
            self._post_forward(h)
        self._post_forward(root)

    def _backward(self) -> None:
        b = self.b
        b.phase = Phase.BACKWARD
        self.seen_grads = set()
        root = self.root
        self._pre_backward(root)  # fires on the loss's gradient, before the head's kernels
        # a unit whose views a forward prefetch made (in the pre-forward before its own) has
        # its AccumulateGrad, so its post-backward, run after the next unit's backward
        # kernels: the engine runs ready nodes latest-created first (recorded: test_fsdp1_fidelity)
        pending: _Handle | None = None
        for u, modules in reversed(self.layout.segments):
            h = self.by_unit[id(u)]
            if h is root:
                self._kernels(h, tuple(reversed(modules)), Phase.BACKWARD)
                if pending is not None:
                    self._post_backward(pending)
                    pending = None
                continue
            if self.checkpointing and self.style == "reentrant":
                b.phase = Phase.RECOMPUTE
                self._pre_forward(h, grad=True)
                self._kernels(h, modules, Phase.RECOMPUTE)
                self._post_forward(h)
                b.phase = Phase.BACKWARD
                self._pre_backward(h)
            elif self.checkpointing:
                self._pre_backward(h)
                b.phase = Phase.RECOMPUTE
                self._kernels(h, modules, Phase.RECOMPUTE)  # the recompute's hooks return at once
                b.phase = Phase.BACKWARD
            else:
                self._pre_backward(h)
            self._kernels(h, tuple(reversed(modules)), Phase.BACKWARD)
            if pending is not None:
                self._post_backward(pending)
            pending = h if h.views_early else None
            if pending is None:
                self._post_backward(h)
        if pending is not None:
            self._post_backward(pending)
        self.acts.end_backward()
        self._post_backward(root)
        self._hook("post-backward final callback")
        if self.sync:  # RU:1099-1105
            self.streams.wait_stream(COMPUTE, POST_BACKWARD)
            if self.replica_group is not None:
                self.streams.wait_stream(COMPUTE, ALL_REDUCE)
        self.post_forward_order.clear()  # exec_order.next_iter(), and each handle's flags (RU:1113-1124)
        for h in self.handles:
            h.post_forward_index, h.prefetched, h.needs_pre_backward = None, False, False

    # ------------------------------------------------------------ hooks
    def _hook(self, what: str) -> None:
        self.b.host(f"FSDP1 {what}", O.HostKind.MODULE_HOOK, self.costs.fsdp1_hook_ns)

    def _pre_forward(self, h: _Handle, grad: bool) -> None:
        if h is not self.root:
            self._hook(f"pre-forward {h.name}")
        h.views_early = h.prefetched  # views are made where the gather is issued (FP:1505-1521)
        if not h.prefetched:
            self._unshard(h)
        h.prefetched, h.needs_pre_forward = False, False
        self._wait_for_unshard()
        h.forward_grad = grad
        if self.cfg.forward_prefetch:  # the next unit of the first iteration's pre-forward order (RU:1280-1289)
            i = self.pre_forward_order.index(h) + 1
            target = self.pre_forward_order[i] if i < len(self.pre_forward_order) else None
            if target is not None and target.needs_pre_forward and not target.prefetched:
                self._unshard(target)
                target.prefetched = True

    def _post_forward(self, h: _Handle) -> None:
        self._hook(f"post-forward {h.name}")
        free = h is not self.root and self.cfg.reshard_after_forward
        self._reshard(h, free)
        # record_post_forward: every call, the index at the first (index 0 is falsy and taken again)
        if not h.post_forward_index:
            h.post_forward_index = len(self.post_forward_order)
        self.post_forward_order.append(h)
        if h.forward_grad:  # _register_pre_backward_hooks returns at once without grad (RU:1391)
            h.needs_pre_backward = True

    def _pre_backward(self, h: _Handle) -> None:
        self._hook(f"pre-backward {h.name}")
        if h.needs_pre_backward:
            if not h.prefetched:
                self._unshard(h)
            self._wait_for_unshard()
        h.prefetched = False
        h.needs_pre_backward = False  # RU:689
        if self.cfg.backward_prefetch == "BACKWARD_PRE":
            self._prefetch(h)

    def _prefetch(self, h: _Handle) -> None:
        """The unit before ``h`` in post-forward order (``get_handle_to_backward_prefetch``),
        if its pre-backward hook is still to unshard it (RU:1266-1279)."""
        i = h.post_forward_index
        target = self.post_forward_order[i - 1] if i else None
        if target is not None and target.needs_pre_backward and not target.prefetched:
            self._unshard(target)
            target.prefetched = True

    def _post_backward(self, h: _Handle) -> None:
        b, u, mb = self.b, h.unit, self.mb
        self._hook(f"post-backward {h.name}")
        flat = f"{mb}fgrad:{h.name}"  # the views' gradients concatenated, for the flat parameter's AccumulateGrad
        cb = self.cdt.itemsize_bytes
        grads = tuple(f"ugrad:{n}" for n in sorted(h.ugrads))
        b.alloc(flat, u.numel * cb, COMPUTE, f"flat gradient of {h.name}")
        self._elementwise(f"{mb}bwd.cat:{h.name}", u.numel, u.numel * cb, u.numel * cb, grads + (flat,))
        for g in grads:
            b.free(g, COMPUTE, "a parameter's gradient (concatenated)")
        h.ugrads.clear()
        new = None
        if h.acc is not None:  # AccumulateGrad adds into the .grad kept from no_sync micro-steps
            self._elementwise(f"{mb}bwd.accumulate_grad:{h.name}", u.numel, 2 * u.numel * cb, u.numel * cb,
                              (h.acc, flat))
            new, flat = flat, h.acc
        # inside no_sync, SHARD_GRAD_OP keeps its parameters gathered (_should_free_in_backward, RU:795-812)
        self._reshard(h, self.sync or self.cfg.reshard_after_forward)
        if self.cfg.backward_prefetch == "BACKWARD_POST":
            self._prefetch(h)
        if self.sync:
            h.acc = None
            (self._reduce_no_shard if self.no_shard else self._reduce)(h, flat)
        else:  # no_sync: the unsharded gradient stays in .grad (RU:743-746)
            h.acc = flat
        if new is not None:  # the engine holds AccumulateGrad's input until its post hook (this one) returns
            b.free(new, COMPUTE, f"new flat gradient of {h.name} (accumulated)")

    # ------------------------------------------------------------ unshard / reshard
    def _unshard(self, h: _Handle) -> None:
        b, c = self.b, self.costs
        src = f"shard:{h.name}"
        mp = self.cdt is not FP32 and (self.no_shard or not h.unsharded)
        if mp:  # FlatParamHandle.pre_unshard (FP:1307-1340): the low-precision shard when it gathers; NO_SHARD always
            src = f"mp_shard:{h.name}"
            b.alloc(src, h.shard * self.cdt.itemsize_bytes, PRE_UNSHARD, f"{h.name}'s shard in {self.cdt.value}")
            b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
            b.compute(PRE_UNSHARD, f"{self.mb}{b.phase.value}.cast:{h.name}", O.ComputeKind.ELEMENTWISE, h.shard,
                      h.shard * 4, h.shard * self.cdt.itemsize_bytes, deps=self.streams.deps(PRE_UNSHARD),
                      buffers=(f"shard:{h.name}", src))
            self.streams.wait_stream(UNSHARD, PRE_UNSHARD)
        if self.cfg.limit_all_gathers and len(self.queue) >= 2:  # _FreeEventQueue.dequeue_if_needed
            event = self.queue.pop(0)
            if event is not None:
                b.sync_ops((event,), "FSDP1 rate limiter: a free two back")
        if not h.unsharded:
            b.alloc(h.full, h.padded * self.cdt.itemsize_bytes, UNSHARD, f"unsharded flat parameter of {h.name}")
            b.host("all_gather launch", O.HostKind.LAUNCH, c.collective_launch_ns)
            b.collective(UNSHARD, f"{self.mb}{b.phase.value}.ag:{h.name}", O.CollectiveKind.ALL_GATHER,
                         h.padded * self.cdt.itemsize_bytes, self.cdt, self.shard_group,
                         deps=self.streams.deps(UNSHARD), buffers=(src, h.full), blocking=True)
            h.unsharded = True
        if mp and not self.no_shard:  # post_unshard; NO_SHARD's goes at its reshard (FP:1784-1803)
            b.free(src, PRE_UNSHARD, f"{h.name}'s low-precision shard")

    def _wait_for_unshard(self) -> None:
        self.streams.wait_stream(COMPUTE, UNSHARD)

    def _reshard(self, h: _Handle, free: bool) -> None:
        if self.no_shard:  # nothing to free but the low-precision copy (post_reshard, FP:1784-1803)
            if self.cdt is not FP32:
                self.b.free(f"mp_shard:{h.name}", PRE_UNSHARD, f"{h.name}'s low-precision copy")
            return
        if not free or not h.unsharded:
            return
        self.b.free(h.full, UNSHARD, f"unsharded flat parameter of {h.name}")
        h.unsharded = False
        if self.cfg.limit_all_gathers:  # a free event on the default stream joins the queue
            self.queue.append(self.b.last_on_stream.get(COMPUTE))


    # ------------------------------------------------------------ kernels' parameters
    def _params_of(self, m: ModuleSpec) -> tuple[str, ...]:
        """A module's parameters are views into its unit's unsharded flat parameter."""
        names = self.param_names.get(m.path)
        if names is None:
            names = self.param_names[m.path] = tuple(dict.fromkeys(self._full(self.unit_of_param[p.name])
                                                                   for p in m.params))
        return names

    def _full(self, h: _Handle) -> str:
        """The buffer a unit's kernels read: its gathered flat parameter; under NO_SHARD the
        flat parameter itself, or its low-precision copy."""
        if not self.no_shard:
            return h.full
        return f"mp_shard:{h.name}" if self.cdt is not FP32 else f"shard:{h.name}"
