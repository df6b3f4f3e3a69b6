"""DeepSpeed ZeRO-3's parameter coordinator: which parameters are gathered, when, how.

Models deepspeed/runtime/zero/partitioned_param_coordinator.py (0.19.x, as summarised
in reference/deepspeed-zero3.md) in the steady state, where the trace is complete
and prefetching is on:

* persistence (parameter_offload.py): parameters of at most
  ``stage3_param_persistence_threshold`` elements, up to
  ``stage3_model_persistence_threshold`` / partition size in all, stay gathered the
  whole step; with ``defragment_persistent`` in one contiguous buffer;
* fetch of a submodule (``fetch_sub_module``): one coalesced all-gather of its
  parameters that are not available, on the all-gather stream; waiting on in-flight
  parameters records an event and blocks the host on the oldest when more than
  ``max_outstanding_coalesced`` are outstanding; then the compute stream waits on the
  whole all-gather stream;
* prefetch: pop this module's entries from the parameter queue, then walk the queue
  up to min(max_live - available numel, prefetch bucket) elements, gathering the
  parameters not yet available in one more coalesced call;
* the gather itself (partition_parameters.py ``_all_gather_params`` and its coalesced
  path): a flat output buffer for more than one parameter, unflattened into each
  parameter's storage on wait; without ``flat_collectives`` an extra flatten buffer
  and copy; hpZ parameters with a secondary shard gather inside the secondary group
  first; MiCS hierarchical gathers run across nodes, then inside the node (mics.py
  ``_hierarchical_all_gather_params``);
* release after use (``release_sub_module``) unless persistent, prefetched for a later
  use, still used by an open module (``ds_active_sub_modules``), or used again within
  ``max_reuse_distance`` elements of upcoming trace; releasing under hpZ keeps a
  secondary shard (``_partition_param_sec``) until the optimizer step invalidates it;
* around the optimizer step: everything released (``release_and_reset_all``), the
  persistent parameters re-gathered synchronously afterwards.

State: each parameter's status, in-flight handles, hpZ secondary shards, outstanding
fetch events and the all-gather count live for the whole step (the constructor makes
them); the parameter queue, the modules holding each parameter, each parameter's most
recent use and the available numel are reset per forward + backward
(``reset_micro_step``, DeepSpeed's ``reset_step``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from commsim.ir import ops as O
from commsim.models.spec import ParamSpec
from commsim.strategies.builder import ProgramBuilder
from commsim.strategies.dsconfig import ZeroConfig
from commsim.strategies.knobs import HostCosts, Knobs
from commsim.strategies.zero3_layout import COMPUTE, Zero3Layout
from commsim.strategies.zero3_trace import TraceEntry

NA, INFLIGHT, AVAILABLE = "not_available", "inflight", "available"


@dataclass
class _Handle:
    """One all-gather call's outstanding work, shared by the parameters it gathers."""

    params: list[ParamSpec]
    flat_buffer: str | None  # coalesced flat output, unflattened and freed on wait
    out_bytes: int
    waited: bool = False


def persistent_params(params: tuple[ParamSpec, ...], threshold: int, model_threshold: int,
                      n_part: int) -> frozenset[str]:
    """Parameters small enough to stay gathered, in ds_id order until the model-wide
    budget (counted per partition rank) is spent."""
    budget = model_threshold // n_part
    out, used = set(), 0
    for p in params:
        if p.numel <= threshold and used + p.numel <= budget:
            out.add(p.name)
            used += p.numel
    return frozenset(out)


class ParamCoordinator:
    """Fetch, prefetch and release of one rank's parameters over one step."""

    def __init__(self, b: ProgramBuilder, layout: Zero3Layout, z: ZeroConfig, knobs: Knobs, costs: HostCosts,
                 trace: list[TraceEntry]):
        self.b, self.layout, self.z, self.knobs, self.costs, self.trace = b, layout, z, knobs, costs, trace
        self.persistent = persistent_params(layout.params, z.param_persistence_threshold,
                                            z.model_persistence_threshold, layout.n_part)
        # the recorded trace's parameter order (DeepSpeed's __param_order): (name, position)
        # for each parameter of each hook call, a module's parameters by ds_id
        self.param_order = tuple((p.name, i) for i, e in enumerate(trace) if e.fetch
                                 for p in layout.unique_in_ds_order(e.module.params))
        # per step
        self.status = {p.name: (AVAILABLE if p.name in self.persistent else NA) for p in layout.params}
        self.handle: dict[str, _Handle] = {}
        self.secondary: set[str] = set()  # hpZ: parameters holding a secondary shard
        self.fetch_events: list[O.OpId] = []
        self.n_ag = 0
        # per forward + backward (reset_micro_step)
        self.queue: deque[tuple[str, int]] = deque()
        self.holders: dict[str, set[str]] = {}  # modules whose fetch holds a parameter
        self.most_recent: dict[str, int] = {}  # trace position a parameter was last fetched for
        self.n_available = 0

    def reset_micro_step(self) -> None:
        """reset_step: queue from the recorded trace, nothing counted available."""
        self.queue = deque(self.param_order)
        self.holders = {p.name: set() for p in self.layout.params}
        self.most_recent = {p.name: -10**10 for p in self.layout.params}
        self.n_available = 0

    def emit_setup(self) -> None:
        """The persistent parameters' storage, gathered before the step."""
        lay = self.layout
        pers = [p for p in lay.params if p.name in self.persistent]
        if pers and self.knobs.defragment_persistent:
            self.b.setup_alloc("persistent", sum(p.numel for p in pers) * lay.dt, "persistent parameters (contiguous)")
        else:
            for p in pers:
                self.b.setup_alloc(self.pbuf(p), lay.part[p.name] * lay.n_part * lay.dt, f"persistent {p.name}")

    def pbuf(self, p: ParamSpec) -> str:
        """The buffer holding ``p`` gathered."""
        if p.name in self.persistent and self.knobs.defragment_persistent:
            return "persistent"
        return f"param:{p.name}"

    # ------------------------------------------------------------ fetch / prefetch
    def fetch(self, i: int, e: TraceEntry) -> tuple[O.OpId, ...]:
        """The pre-hook at trace position ``i``: gather, wait, prefetch. Returns the deps
        the module's first kernel needs."""
        b, c, lay = self.b, self.costs, self.layout
        m = e.module
        b.host(f"hook {m.path}", O.HostKind.MODULE_HOOK, c.module_hook_ns)
        params = lay.unique_in_ds_order(m.params)
        for p in params:
            self.holders[p.name].add(m.path)
        examined = len(params)
        self._all_gather(params, "fetch")
        for p in params:
            if self.status[p.name] == INFLIGHT:
                self._wait(p)
        deps = b.wait_stream(lay.ag_stream) if self.knobs.fine_grained_sync and lay.ag_stream != COMPUTE else ()
        examined += self._prefetch(i, m.path, params)
        if not self.knobs.precomputed_fetch:
            b.host(f"fetch decisions {m.path}", O.HostKind.PYTHON, c.fetch_decision_per_param_ns * max(examined, 1))
        if self.knobs.debug_string_ops and params:
            b.host("debug string", O.HostKind.DEBUG, c.debug_string_ns)
            norm = b.compute(COMPUTE, f"{m.path}.debug_norm", O.ComputeKind.ELEMENTWISE, sum(p.numel for p in params),
                             sum(p.numel for p in params) * lay.dt, 4, deps=deps,
                             buffers=tuple(dict.fromkeys(self.pbuf(p) for p in params)))
            cp = b.copy(COMPUTE, f"{m.path}.debug_item", O.CopyDirection.D2H, 4, deps=(norm,))
            b.sync_ops((cp,), "debug string .item()")
        return deps

    def _prefetch(self, i: int, path: str, params: list[ParamSpec]) -> int:
        """Pop this fetch's own queue entries, then gather ahead along the queue. Returns
        the queue entries examined beyond this module's own."""
        not_fetched = {p.name for p in params if self.most_recent[p.name] < i}
        discarded: set[str] = set()
        while self.queue and len(discarded) < len(not_fetched):
            name, used_at = self.queue.popleft()
            self.most_recent[name] = used_at
            discarded.add(name)
        assert discarded == not_fetched, (i, path, discarded, not_fetched)
        examined = 0
        if self.z.prefetch_bucket_size > 0:
            budget = min(self.z.max_live_parameters - self.n_available, self.z.prefetch_bucket_size)
            chosen: dict[str, ParamSpec] = {}
            numel = 0
            while self.queue and numel < budget:
                name, used_at = self.queue.popleft()
                examined += 1
                self.most_recent[name] = max(self.most_recent[name], used_at)
                if self.status[name] == NA and name not in chosen:
                    chosen[name] = self.layout.by_name[name]
                    numel += self.layout.by_name[name].numel
            if chosen:
                self._all_gather(list(chosen.values()), "prefetch")
        return examined

    def _wait(self, p: ParamSpec) -> None:
        """Wait on an in-flight parameter (the host-side part of fetch's wait loop)."""
        b, s = self.b, self.layout.ag_stream
        m = self.knobs.max_outstanding_coalesced
        if m and len(self.fetch_events) > m:
            b.sync_ops((self.fetch_events[-(m + 1)],), "fetch back-pressure: oldest outstanding all-gather")
        h = self.handle.pop(p.name)
        if not h.waited:
            h.waited = True
            if h.flat_buffer is not None:
                names = tuple(dict.fromkeys(self.pbuf(q) for q in h.params))
                b.host("launch", O.HostKind.LAUNCH, self.costs.launch_ns)
                b.copy(s, f"unflatten {h.params[0].name}+{len(h.params) - 1}", O.CopyDirection.D2D,
                       sum(q.numel for q in h.params) * self.layout.dt, buffers=(h.flat_buffer,) + names)
                b.free(h.flat_buffer, s, "coalesced all-gather buffer")
        self.status[p.name] = AVAILABLE
        last = b.last_on_stream.get(s)
        if last is not None:
            self.fetch_events.append(last)

    # ------------------------------------------------------------ all-gather
    def _all_gather(self, params: list[ParamSpec], why: str) -> None:
        params = self.layout.in_ds_order(p for p in params if self.status[p.name] == NA)
        if not params:
            return
        self.n_available += sum(p.numel for p in params)
        # hpZ: parameters with a secondary copy gather inside its group, first
        # (partitioned_param_coordinator.__all_gather_params_); the others over the partition group.
        sec = [p for p in params if p.name in self.secondary]
        for part in (sec, [p for p in params if p.name not in self.secondary]):
            if not part:
                continue
            batches = [part] if self.knobs.coalesced_collectives else [[p] for p in part]
            for batch in batches:
                self._all_gather_call(batch, why, secondary=part is sec)

    def _all_gather_call(self, batch: list[ParamSpec], why: str, secondary: bool = False) -> None:
        b, c, lay, s = self.b, self.costs, self.layout, self.layout.ag_stream
        self.n_ag += 1
        k = self.n_ag
        shard = sum(lay.part[p.name] for p in batch)
        out_bytes = shard * lay.n_part * lay.dt
        for p in batch:
            if self.pbuf(p) == "persistent":
                continue
            size = lay.part[p.name] * lay.n_part * lay.dt  # storage of the padded full parameter
            b.alloc(self.pbuf(p), size, s, f"gathered {p.name}")
        names = tuple(dict.fromkeys(self.pbuf(p) for p in batch))
        flat = None
        if len(batch) > 1:
            flat = f"agflat[{k}]"
            b.alloc(flat, out_bytes, s, f"coalesced all-gather buffer {k}")
            b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
            b.copy(s, f"ag{k}.copy_in", O.CopyDirection.D2D, shard * lay.dt, buffers=(flat, "flat16[0]"))
        target = (flat,) if flat else names
        tmp = None
        if not self.knobs.flat_collectives:
            tmp = f"agtmp[{k}]"
            b.alloc(tmp, out_bytes, s, f"all-gather flatten buffer {k}")
            target = (tmp,)
        label = f"{b.phase.value}.ag{k}.{why}:{batch[0].name}" + (f"+{len(batch) - 1}" if len(batch) > 1 else "")
        g = lay.groups
        if secondary:
            b.host("all_gather launch", O.HostKind.LAUNCH, c.collective_launch_ns)
            b.collective(s, label + ".hpz", O.CollectiveKind.ALL_GATHER, out_bytes, lay.dtype, g.secondary,
                         buffers=target)
        elif g.inter is not None:
            # MiCS hierarchical (mics.py _hierarchical_all_gather_params): across nodes
            # (same local rank) into the output, a clone of that part copied to where the
            # intra-node gather expects it, then the gather inside the node
            stage = f"aghier[{k}]"
            mid = out_bytes // len(g.intra)
            b.host("all_gather launch", O.HostKind.LAUNCH, c.collective_launch_ns)
            b.collective(s, label + ".inter", O.CollectiveKind.ALL_GATHER, mid, lay.dtype, g.inter, buffers=target)
            b.alloc(stage, mid, s, f"hierarchical all-gather clone {k}")
            b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
            b.copy(s, f"ag{k}.hier_clone", O.CopyDirection.D2D, mid, buffers=target + (stage,))
            b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
            b.copy(s, f"ag{k}.hier_place", O.CopyDirection.D2D, mid, buffers=(stage,) + target)
            b.free(stage, s, f"hierarchical all-gather clone {k}")
            b.host("all_gather launch", O.HostKind.LAUNCH, c.collective_launch_ns)
            b.collective(s, label + ".intra", O.CollectiveKind.ALL_GATHER, out_bytes, lay.dtype, g.intra,
                         buffers=target)
        else:
            b.host("all_gather launch", O.HostKind.LAUNCH, c.collective_launch_ns)
            b.collective(s, label, O.CollectiveKind.ALL_GATHER, out_bytes, lay.dtype, g.partition, buffers=target)
        if tmp:
            b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
            b.copy(s, f"ag{k}.unflatten_list", O.CopyDirection.D2D, out_bytes,
                   buffers=(tmp,) + ((flat,) if flat else names))
            b.free(tmp, s, f"all-gather flatten buffer {k}")
        if not self.knobs.fine_grained_sync:
            b.sync_device(f"ag{k}: device-wide synchronize after all-gather")
        handle = _Handle(batch, flat, out_bytes)
        for p in batch:
            self.status[p.name] = INFLIGHT
            self.handle[p.name] = handle

    # ------------------------------------------------------------ release
    def release(self, step_id: int, e: TraceEntry) -> None:
        """The post-hook of ``e``; ``step_id`` is the next trace position."""
        m = e.module
        release = {p.name for p in m.params if p.name not in self.persistent}
        release = {n for n in release if self.most_recent[n] <= step_id}
        traversed = 0
        for later in self.trace[step_id:]:
            if not later.fetch:  # only hook calls are positions of DeepSpeed's trace
                continue
            if traversed >= self.z.max_reuse_distance:
                break
            for p in later.module.params:
                release.discard(p.name)
                traversed += p.numel
        for p in self.layout.unique_in_ds_order(m.params):
            holders = self.holders[p.name]
            holders.discard(m.path)
            # ds_active_sub_modules: a parameter another open module still uses stays.
            if p.name in release and self.status[p.name] == AVAILABLE and not holders:
                self._free_param(p)

    def release_all(self) -> None:
        """release_and_reset_all, before the optimizer step: persistent parameters too."""
        for p in self.layout.params:
            if self.status[p.name] == AVAILABLE:
                self._free_param(p)

    def _free_param(self, p: ParamSpec) -> None:
        b, lay = self.b, self.layout
        if lay.hpz > 1 and p.name not in self.secondary:
            # hpZ: partitioning an available parameter keeps a secondary shard of it,
            # 1/h of the padded parameter, until the optimizer step invalidates it
            # (partition_parameters._partition_param_sec)
            size = lay.part[p.name] * lay.n_part // lay.hpz * lay.dt
            b.alloc(f"sec:{p.name}", size, COMPUTE, f"hpZ secondary shard of {p.name}")
            b.host("launch", O.HostKind.LAUNCH, self.costs.launch_ns)
            b.copy(COMPUTE, f"hpz.secondary:{p.name}", O.CopyDirection.D2D, size,
                   buffers=(self.pbuf(p), f"sec:{p.name}"))
            self.secondary.add(p.name)
        self.status[p.name] = NA
        self.n_available -= p.numel
        if self.pbuf(p) != "persistent":
            b.free(self.pbuf(p), COMPUTE, f"release {p.name}")

    # ------------------------------------------------------------ after the optimizer step
    def gather_persistent(self) -> None:
        """Synchronous gather (stage3._post_step -> Init._all_gather): one all-gather per
        persistent parameter, all launched, then all waited; no coordinator back-pressure."""
        pers = [p for p in self.layout.params if p.name in self.persistent]
        if not pers:
            return
        for p in pers:
            self._all_gather_call([p], "persistent")
        for p in pers:
            self.handle.pop(p.name)
            self.status[p.name] = AVAILABLE
        self.b.sync_stream(self.layout.ag_stream, "synchronous gather of persistent parameters")

    def invalidate_secondary(self) -> None:
        """hpZ's secondary shards are dropped after the step (invalidate_secondary_tensor)."""
        for name in sorted(self.secondary, key=lambda n: self.layout.ds_id[n]):
            self.b.free(f"sec:{name}", COMPUTE, f"hpZ secondary shard of {name} (invalidated after the step)")
        self.secondary.clear()
