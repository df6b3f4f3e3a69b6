"""DeepSpeed ZeRO-3's parameter coordinator: which parameters are gathered, when, how.

Models the steady state (the trace is complete, so prefetching is on) of three
releases: 0.19.8's partitioned_param_coordinator.py (as summarised in
reference/deepspeed-zero3.md), 0.6.0's coordinator in stage3.py (s3:172-493), which
0.19.8's grew from, and 0.5.10's (s3:157-543 with partition_parameters.py, ``pp``).
The seed's changes between 0.5.10 and 0.6.0 are knobs (knobs.py); the other release
differences are ``DeepSpeedVersion`` behaviours (dsversions.py).

* persistence: parameters below ``stage3_param_persistence_threshold`` elements
  (``<=`` from 0.19, which also has a model-wide budget per partition) stay gathered
  until the step releases everything; each has its own storage, released and
  re-gathered every step (no release defragments them: 0.5.10 and 0.6.0 flatten only
  the shards, at init);
* fetch of a submodule: its parameters that are not available are all-gathered on the
  all-gather stream, one coalesced call or (``coalesced_collectives`` off) one per
  parameter. Then, with ``fine_grained_sync`` (0.6.0 on), each in-flight parameter is
  waited with an event, the host blocking on the oldest beyond
  ``max_outstanding_coalesced``, and the compute stream waits on the all-gather
  stream; without it (0.5.10), the demand gathers end with a device-wide synchronize
  and a fetch needing an in-flight or unavailable parameter synchronises the
  all-gather stream and then the device, completing every prefetch in flight;
* ``debug_string_ops`` (0.5.10): a norm of every parameter of the fetched module,
  read by the host;
* prefetch: with ``precomputed_fetch`` (0.6.0), pop this module's entries from the
  parameter queue, then pop up to min(max_live - available, prefetch bucket)
  elements, gathering those not available in one more call; without it (0.5.10),
  only when no prefetch is in flight, walk the module trace from here collecting
  unavailable parameters until the bucket is reached, each gathered into a zero-filled
  buffer (``empty_gather_buffers`` off) after a device-wide synchronize;
* the gather itself (zero3_gather.py): a flat output for more than one parameter,
  copied into each parameter's storage on wait; hpZ, MiCS, 0.5.4's list all_gather;
* release after use unless persistent, still used by an open module
  (``ds_active_sub_modules``), or used again within ``max_reuse_distance`` elements
  (0.6.0, and 0.19.8, which also keeps parameters whose later use the prefetcher
  already passed; never in 0.5.10, see ``release``); releasing under hpZ keeps a
  secondary shard (``_partition_param_sec``) until the optimizer step invalidates it;
* everything released at the end of each backward (0.5.10) or before the optimizer
  step, the persistent parameters re-gathered after it: one all-gather each on the
  default stream, then a device-wide synchronize (pp:919-986 / pp:1245-1312 /
  0.19.8's ``_allgather_params_coalesced``).

Host time: each hook's fixed and per-parameter Python and the gathers' and releases'
per-parameter Python, from ``HostCosts`` (measured per release).

State: each parameter's status, in-flight handles, hpZ secondary shards, outstanding
fetch events and the all-gather count live for the whole step (the constructor makes
them); the parameter queue, the modules holding each parameter, each parameter's most
recent use and (0.6.0 on) the available numel are reset per forward + backward
(``reset_micro_step``, DeepSpeed's ``reset_step``).
"""

from __future__ import annotations

from collections import deque

from commsim.ir import ops as O
from commsim.models.spec import ParamSpec
from commsim.strategies.builder import ProgramBuilder
from commsim.strategies.dsconfig import ZeroConfig
from commsim.strategies.dsversions import CURRENT, DeepSpeedVersion
from commsim.strategies.knobs import HostCosts, Knobs
from commsim.strategies.zero3_gather import AVAILABLE, INFLIGHT, NA, AllGathers, Handle
from commsim.strategies.zero3_layout import COMPUTE, Zero3Layout
from commsim.strategies.zero3_trace import TraceEntry


def persistent_params(params: tuple[ParamSpec, ...], threshold: int, model_threshold: int,
                      n_part: int, inclusive: bool = True) -> frozenset[str]:
    """Parameters small enough to stay gathered: at most ``threshold`` elements
    (``inclusive``, 0.19.8) or fewer (0.5.10, 0.6.0), in ds_id order until the
    model-wide budget (counted per partition rank) is spent."""
    budget = model_threshold // n_part
    out, used = set(), 0
    for p in params:
        small = p.numel <= threshold if inclusive else p.numel < threshold
        if small and used + p.numel <= budget:
            out.add(p.name)
            used += p.numel
    return frozenset(out)


class ParamCoordinator(AllGathers):
    """Fetch, prefetch and release of one rank's parameters over one step."""

    def __init__(self, b: ProgramBuilder, layout: Zero3Layout, z: ZeroConfig, knobs: Knobs, costs: HostCosts,
                 trace: list[TraceEntry], version: DeepSpeedVersion = CURRENT):
        self.b, self.layout, self.z, self.knobs, self.costs, self.trace = b, layout, z, knobs, costs, trace
        self.version = version
        cap = z.model_persistence_threshold if version.model_persistence_cap else 2**63
        self.persistent = persistent_params(layout.params, z.param_persistence_threshold, cap, layout.n_part,
                                            inclusive=version.persistence_inclusive)
        # the recorded trace's parameter order (DeepSpeed's __param_order): (name, position)
        # for each parameter of each hook call, a module's parameters by ds_id
        self.param_order = tuple((p.name, i) for i, e in enumerate(trace) if e.fetch
                                 for p in layout.unique_in_ds_order(e.module.params))
        # per step
        self.status = {p.name: (AVAILABLE if p.name in self.persistent else NA) for p in layout.params}
        self.handle: dict[str, Handle] = {}
        self.secondary: set[str] = set()  # hpZ: parameters holding a secondary shard
        self.fetch_events: list[O.OpId] = []
        self.n_ag = 0
        self.n_available = 0
        # per forward + backward (reset_micro_step)
        self.queue: deque[tuple[str, int]] = deque()
        self.holders: dict[str, set[str]] = {}  # modules whose fetch holds a parameter
        self.most_recent: dict[str, int] = {}  # trace position a parameter was last fetched for

    def reset_micro_step(self) -> None:
        """reset_step: queue from the recorded trace (0.6.0 on: s3:261-286; 0.5.10 resets
        only its step counter, s3:206-207)."""
        self.queue = deque(self.param_order)
        self.holders = {p.name: set() for p in self.layout.params}
        self.most_recent = {p.name: -10**10 for p in self.layout.params}
        self.n_available = 0

    def emit_setup(self) -> None:
        """The persistent parameters' storage, gathered before the step."""
        lay = self.layout
        for p in lay.params:
            if p.name in self.persistent:
                self.b.setup_alloc(self.pbuf(p), lay.part[p.name] * lay.n_part * lay.dt, f"persistent {p.name}")

    # ------------------------------------------------------------ fetch / prefetch
    def fetch(self, i: int, e: TraceEntry) -> tuple[O.OpId, ...]:
        """The pre-hook at trace position ``i``: gather, wait, prefetch. Returns the deps
        the module's first kernel needs."""
        b, c, lay = self.b, self.costs, self.layout
        m = e.module
        params = lay.unique_in_ds_order(m.params)
        b.host(f"hook {m.path}", O.HostKind.MODULE_HOOK,
               c.hook_plumbing_ns + c.module_hook_ns + c.fetch_param_ns * len(params))
        for p in params:
            self.holders[p.name].add(m.path)
        if self.knobs.fine_grained_sync:
            deps = self._fetch_with_events(params)
        else:
            deps = self._fetch_host_synchronised(params)
        if self.knobs.debug_string_ops:
            self._debug_norms(m.path, params, deps)
        if self.knobs.precomputed_fetch:
            self._prefetch_from_queue(i, m.path, params)
        # 0.5.10's PrefetchCoordinator never prefetches in the steady state: its trace is
        # recorded one position off the step counter it is read with (the root module's
        # reset_step hook, s3:1364-1377, runs after the root's own fetch hook, registered
        # first by _register_hooks_recursively, s3:1397-1509), so get_params_to_prefetch
        # finds another module at every position but the first and returns nothing
        # (s3:220-225). Its Python still runs: it is in the fetch hook's measured cost.
        return deps

    def _fetch_with_events(self, params: list[ParamSpec]) -> tuple[O.OpId, ...]:
        """0.6.0 s3:308-335 (0.19.8 ppc:364-415): gather what is missing, wait on each
        in-flight parameter, then the compute stream waits on the all-gather stream."""
        lay = self.layout
        self._all_gather(params, "fetch")
        for p in params:
            if self.status[p.name] == INFLIGHT:
                self._wait(p)
        return self.b.wait_stream(lay.ag_stream) if lay.ag_stream != COMPUTE else ()

    def _fetch_host_synchronised(self, params: list[ParamSpec]) -> tuple[O.OpId, ...]:
        """0.5.10 fetch_sub_module (s3:398-459): the missing parameters gathered and the
        device synchronised (``_allgather_params_coalesced``, pp:974-984); then, if any
        parameter was missing or in flight, ``_synchronize_communication`` (s3:534-545):
        every in-flight handle waited, the all-gather stream and the whole device
        synchronised. Nothing else orders the module's kernels after the gathers.
        0.5.4 (``demand_gather_per_param``) takes the per-parameter path instead, each
        gather behind its own device synchronize (pp:835-880), and only
        ``_synchronize_communication`` follows."""
        b, lay = self.b, self.layout
        need = [p for p in params if self.status[p.name] == NA]
        in_flight = any(self.status[p.name] == INFLIGHT for p in params)
        if need:
            self._all_gather(need, "fetch")
            if not self.version.demand_gather_per_param:
                b.sync_device("demand all-gather: torch.cuda.synchronize() (pp:984)")
        if not (need or in_flight):
            return ()
        b.sync_stream(lay.ag_stream, "fetch: all-gather stream synchronize (s3:541)")
        b.sync_device("fetch: torch.cuda.synchronize() (s3:542)")
        copied = False
        for name in [n for n, st in self.status.items() if st == INFLIGHT]:
            copied |= self._complete(name)
        # a coalesced gather's copy into the parameters runs after the synchronize
        return b.wait_stream(lay.ag_stream) if copied and lay.ag_stream != COMPUTE else ()

    def _debug_norms(self, path: str, params: list[ParamSpec], deps: tuple[O.OpId, ...]) -> None:
        """0.5.10 s3:454-458: f"... norm={param.norm()}" for every parameter of the module:
        the norm on the compute stream, then formatting the 0-d result reads it (.item())."""
        b, c, lay = self.b, self.costs, self.layout
        for j, p in enumerate(params):
            b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
            norm = b.compute(COMPUTE, f"{path}.debug_norm:{p.name}", O.ComputeKind.ELEMENTWISE, 2 * p.numel,
                             p.numel * lay.dt, lay.dt, deps=deps if j == 0 else (), buffers=(self.pbuf(p),))
            cp = b.copy(COMPUTE, f"{path}.debug_item:{p.name}", O.CopyDirection.D2H, lay.dt, deps=(norm,))
            b.sync_ops((cp,), "debug string: .item() of param.norm()")
            b.host("debug string", O.HostKind.DEBUG, c.debug_string_ns)

    def _prefetch_from_queue(self, i: int, path: str, params: list[ParamSpec]) -> None:
        """0.6.0 s3:345-380 / 0.19.8 ppc:422-484: pop this fetch's own queue entries, then
        gather ahead along the queue."""
        not_fetched = {p.name for p in params if self.most_recent[p.name] < i}
        discarded: set[str] = set()
        # (the queue yields one entry per parameter a fetch visits over a step: its Python
        # is in HostCosts.fetch_param_ns)
        while self.queue and len(discarded) < len(not_fetched):
            name, used_at = self.queue.popleft()
            self.most_recent[name] = used_at
            discarded.add(name)
        assert discarded == not_fetched, (i, path, discarded, not_fetched)
        if self.z.prefetch_bucket_size > 0:
            budget = min(self.z.max_live_parameters - self.n_available, self.z.prefetch_bucket_size)
            chosen: dict[str, ParamSpec] = {}
            numel = 0
            while self.queue and numel < budget:
                name, used_at = self.queue.popleft()
                self.most_recent[name] = max(self.most_recent[name], used_at)
                p = self.layout.by_name[name]
                if name in chosen:
                    continue
                if self.status[name] == NA:
                    chosen[name] = p
                    numel += p.numel
                elif self.version.prefetch_counts_available:
                    chosen[name] = p  # 0.6.0 counts it; __all_gather_params skips it
                    numel += p.numel
            gather = [p for p in chosen.values() if self.status[p.name] == NA]
            if gather:
                self._all_gather(gather, "prefetch")

    def _wait(self, p: ParamSpec) -> None:
        """Wait on an in-flight parameter (the host-side part of fetch's wait loop)."""
        b, s = self.b, self.layout.ag_stream
        m = self.knobs.max_outstanding_coalesced
        if len(self.fetch_events) > m:
            b.sync_ops((self.fetch_events[-(m + 1)],), "fetch back-pressure: oldest outstanding all-gather")
        self._complete(p.name)
        last = b.last_on_stream.get(s)
        if last is not None:
            self.fetch_events.append(last)

    def _complete(self, name: str) -> bool:
        """An in-flight parameter's handle waited: a coalesced gather's flat output is
        copied into its parameters' storage on the all-gather stream, once. True if
        that copy was emitted now."""
        b, s = self.b, self.layout.ag_stream
        h = self.handle.pop(name)
        self.status[name] = AVAILABLE
        if h.waited:
            return False
        h.waited = True
        b.host("wait", O.HostKind.PYTHON, self.costs.wait_ns(len(h.params), self.layout.n_part))
        if h.flat_buffer is None:
            return False
        names = tuple(dict.fromkeys(self.pbuf(q) for q in h.params))
        b.host("launch", O.HostKind.LAUNCH, self.costs.launch_ns)
        b.copy(s, f"unflatten {h.params[0].name}+{len(h.params) - 1}", O.CopyDirection.D2D,
               sum(q.numel for q in h.params) * self.layout.dt, buffers=(h.flat_buffer,) + names)
        b.free(h.flat_buffer, s, "coalesced all-gather buffer")
        return True

    # ------------------------------------------------------------ release
    def release(self, step_id: int, e: TraceEntry) -> None:
        """The post-hook of ``e``; ``step_id`` is the next trace position."""
        m = e.module
        params = self.layout.unique_in_ds_order(m.params)
        c = self.costs
        self.b.host(f"release {m.path}", O.HostKind.MODULE_HOOK,
                    c.hook_plumbing_ns + c.release_hook_ns + c.release_param_ns * len(params))
        if self.knobs.precomputed_fetch:
            release = self._params_to_release(step_id, e)
        else:
            # 0.5.10 _keep_for_later (s3:513-521): get_reuse_distance_in_numel reads the
            # same offset trace, finds another module at the module's position and answers
            # "no reuse" (10**12 elements, s3:248-258): every non-persistent parameter is
            # released after each use
            release = {p.name for p in params if p.name not in self.persistent}
        for p in params:
            holders = self.holders[p.name]
            holders.discard(m.path)
            # ds_active_sub_modules: a parameter another open module still uses stays.
            if p.name in release and self.status[p.name] == AVAILABLE and not holders:
                self._free_param(p)

    def _params_to_release(self, step_id: int, e: TraceEntry) -> set[str]:
        """0.6.0 s3:444-466 / 0.19.8 ppc:634-664: the module's non-persistent parameters
        not used again within max_reuse_distance elements of the coming trace."""
        release = {p.name for p in e.module.params if p.name not in self.persistent}
        if self.version.release_keeps_passed_reuse:
            release = {n for n in release if self.most_recent[n] <= step_id}
        traversed = 0
        stop_at_equal = self.version.reuse_scan_stops_at_equal
        for later in self.trace[step_id:]:
            if not later.fetch:  # only hook calls are positions of DeepSpeed's trace
                continue
            if traversed > self.z.max_reuse_distance or (stop_at_equal and traversed == self.z.max_reuse_distance):
                break
            for p in later.module.params:
                release.discard(p.name)
                traversed += p.numel
        return release

    def release_all(self) -> None:
        """Every available parameter released, persistent ones too: 0.5.10 at the end of
        each backward (_partition_all_parameters, s3:2948), later releases before the
        optimizer step (release_and_reset_all)."""
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
        b.host("free", O.HostKind.PYTHON, self.costs.free_param_ns)
        b.free(self.pbuf(p), COMPUTE, f"release {p.name}")
        if self.version.release_host_copy:
            # 0.5.4 pp:728: param.data = torch.ones(1, dtype).to(param.device), a copy from
            # pageable memory: cudaMemcpyAsync then a wait for the current stream, so the
            # host waits for every kernel queued before it (the 2-byte tensor itself is
            # left out of the allocator's blocks)
            b.host("launch", O.HostKind.LAUNCH, self.costs.launch_ns)
            cp = b.copy(COMPUTE, f"release.ones_h2d:{p.name}", O.CopyDirection.H2D, lay.dt)
            b.sync_ops((cp,), "release: torch.ones(1).to(device) (pp:728)")

    def invalidate_secondary(self) -> None:
        """hpZ's secondary shards are dropped after the step (invalidate_secondary_tensor)."""
        for name in sorted(self.secondary, key=lambda n: self.layout.ds_id[n]):
            self.b.free(f"sec:{name}", COMPUTE, f"hpZ secondary shard of {name} (invalidated after the step)")
        self.secondary.clear()
