"""DeepSpeed ZeRO-3's all-gather paths: how a set of parameters is gathered.

A mixin of ``zero3_params.ParamCoordinator`` (which decides what is gathered when):

* a batch's gather: each parameter's storage allocated on the all-gather stream; for
  more than one parameter a flat output, the shard copied in and, on wait, the output
  copied into each parameter's storage; hpZ parameters with a secondary shard gather
  inside the secondary group first; MiCS hierarchical gathers run across nodes, then
  inside the node (mics.py ``_hierarchical_all_gather_params``);
* ``_allgather_param``, the per-parameter path (0.5.10's prefetch; every demand gather
  of 0.5.4): a zero-filled buffer (``empty_gather_buffers`` off) and a device-wide
  synchronize before the call (``fine_grained_sync`` off);
* 0.5.4's list all_gather (``DeepSpeedVersion.list_all_gather``): the shard copied
  into its slot of the output list, ProcessGroupNCCL's own flat output, one copy out
  per rank;
* the persistent parameters after the optimizer step: one all-gather per parameter
  then a device-wide synchronize (0.5.10 on: ``_allgather_params_coalesced``), or
  0.5.4's synchronous path, one list all_gather copied out in Python
  (``sync_gather_copies_out``).

File references are to the released sources (``pp`` = partition_parameters.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from commsim.ir import ops as O
from commsim.models.spec import ParamSpec
from commsim.strategies.builder import ProgramBuilder
from commsim.strategies.dsversions import DeepSpeedVersion
from commsim.strategies.knobs import HostCosts, Knobs
from commsim.strategies.zero3_layout import COMPUTE, Zero3Layout

NA, INFLIGHT, AVAILABLE = "not_available", "inflight", "available"


@dataclass
class Handle:
    """One all-gather call's outstanding work, shared by the parameters it gathers."""

    params: list[ParamSpec]
    flat_buffer: str | None  # coalesced flat output, unflattened and freed on wait
    out_bytes: int
    waited: bool = False


class AllGathers:
    """The gather calls of a ``ParamCoordinator`` (its state: ``status``, ``handle``,
    ``secondary``, ``persistent``, ``n_available``, the call counters)."""

    b: ProgramBuilder
    layout: Zero3Layout
    knobs: Knobs
    costs: HostCosts
    version: DeepSpeedVersion
    status: dict[str, str]
    handle: dict[str, Handle]
    secondary: set[str]
    persistent: frozenset[str]
    n_available: int
    n_ag: int

    def pbuf(self, p: ParamSpec) -> str:
        """The buffer holding ``p`` gathered."""
        return f"param:{p.name}"

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

    def _all_gather_call(self, batch: list[ParamSpec], why: str, secondary: bool = False,
                         stream: str | None = None) -> None:
        b, c, lay = self.b, self.costs, self.layout
        s = stream or lay.ag_stream
        self.n_ag += 1
        k = self.n_ag
        shard = sum(lay.part[p.name] for p in batch)
        out_bytes = shard * lay.n_part * lay.dt
        b.host("gather", O.HostKind.PYTHON, c.gather_ns(len(batch), lay.n_part))
        for p in batch:
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
        # _allgather_param: the prefetch path (0.5.10), every gather but the persistent
        # parameters' in 0.5.4
        per_param_path = why == "prefetch" or (why == "fetch" and self.version.demand_gather_per_param)
        if per_param_path and not self.knobs.empty_gather_buffers:
            # 0.5.10 _allgather_param: torch.zeros(aligned_param_size) (pp:875; 0.5.4 pp:850)
            b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
            b.compute(s, f"ag{k}.zero_fill", O.ComputeKind.ELEMENTWISE, 0, 0, out_bytes, buffers=target)
        if per_param_path and not self.knobs.fine_grained_sync:
            # 0.5.10 _allgather_param: torch.cuda.synchronize() before the all-gather (pp:882; 0.5.4 pp:857)
            b.sync_device(f"ag{k}: torch.cuda.synchronize() before the {why} all-gather (pp:882)")
        label = f"{b.phase.value}.ag{k}.{why}:{batch[0].name}" + (f"+{len(batch) - 1}" if len(batch) > 1 else "")
        if self.version.list_all_gather and not secondary and lay.groups.inter is None:
            # 0.5.4: the shard copied into its own slot of the output list (pp:873),
            # then the list all_gather (pp:875-878)
            b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
            b.copy(s, f"ag{k}.shard_in", O.CopyDirection.D2D, shard * lay.dt, buffers=target)
            self._list_all_gather(k, s, label, out_bytes, target)
            self._gathered(batch, flat, out_bytes)
            return
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
        self._gathered(batch, flat, out_bytes)

    def _gathered(self, batch: list[ParamSpec], flat: str | None, out_bytes: int) -> None:
        handle = Handle(batch, flat, out_bytes)
        for p in batch:
            self.status[p.name] = INFLIGHT
            self.handle[p.name] = handle

    def _list_all_gather(self, k: int, s: str, label: str, out_bytes: int, target: tuple[str, ...]) -> None:
        """torch.distributed.all_gather with a list of outputs on NCCL (PyTorch 1.8-1.10's
        ProcessGroupNCCL::allgather): a flat buffer of its own allocated for NCCL's
        output, then each rank's piece copied out to its list entry, one ``copy_`` per
        rank launched from the calling thread; the buffer freed after."""
        b, c, lay = self.b, self.costs, self.layout
        tmp = f"aglist[{k}]"  # (k: the gather call's number)
        b.alloc(tmp, out_bytes, s, "list all_gather: ProcessGroupNCCL's flat output")
        b.host("all_gather launch", O.HostKind.LAUNCH, c.collective_launch_ns)
        b.collective(s, label, O.CollectiveKind.ALL_GATHER, out_bytes, lay.dtype, lay.groups.partition,
                     buffers=(tmp,))
        b.host("launch", O.HostKind.LAUNCH, c.launch_ns * lay.n_part)
        b.copy(s, f"{label}.copy_out", O.CopyDirection.D2D, out_bytes, buffers=(tmp,) + target)
        b.free(tmp, s, "list all_gather: ProcessGroupNCCL's flat output")

    # ------------------------------------------------------------ after the optimizer step
    def gather_persistent(self) -> None:
        """Synchronous gather (stage3._post_step -> _allgather_params_coalesced): one
        all-gather per persistent parameter on the default stream, all launched, then a
        device-wide synchronize; no coordinator back-pressure."""
        pers = [p for p in self.layout.params if p.name in self.persistent]
        if not pers:
            return
        if self.version.sync_gather_copies_out:
            self._gather_copied_out(pers)
            return
        for p in pers:
            self._all_gather_call([p], "persistent", stream=COMPUTE)
        for p in pers:
            self.handle.pop(p.name)
            self.status[p.name] = AVAILABLE
        self.b.sync_device("synchronous gather of persistent parameters: torch.cuda.synchronize()")

    def _gather_copied_out(self, pers: list[ParamSpec]) -> None:
        """0.5.4's synchronous gather (_allgather_params, pp:884-938) on the current
        stream: the shards copied one by one into a flat buffer, one list all_gather of
        it, then each parameter copied out into a new tensor, one ``copy_`` per rank
        (its launches charged per rank, its bytes as one op); nothing synchronises."""
        b, c, lay = self.b, self.costs, self.layout
        self.n_ag += 1
        k = self.n_ag
        shard = sum(lay.part[p.name] for p in pers)
        out_bytes = shard * lay.n_part * lay.dt
        flat = f"agflat[{k}]"
        b.alloc(flat, out_bytes, COMPUTE, f"synchronous all-gather buffer {k}")
        for p in pers:
            b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
            b.copy(COMPUTE, f"ag{k}.shard_in:{p.name}", O.CopyDirection.D2D, lay.part[p.name] * lay.dt,
                   buffers=(flat,))
        self._list_all_gather(k, COMPUTE, f"{b.phase.value}.ag{k}.persistent:{pers[0].name}+{len(pers) - 1}",
                              out_bytes, (flat,))
        for p in pers:
            b.alloc(self.pbuf(p), lay.part[p.name] * lay.n_part * lay.dt, COMPUTE, f"gathered {p.name}")
            b.host("launch", O.HostKind.LAUNCH, c.launch_ns * lay.n_part)
            b.copy(COMPUTE, f"ag{k}.copy_out:{p.name}", O.CopyDirection.D2D, p.numel * lay.dt,
                   buffers=(flat, self.pbuf(p)))
            self.status[p.name] = AVAILABLE
        b.free(flat, COMPUTE, f"synchronous all-gather buffer {k}")
