"""Record, on rank 0 of a real FSDP1 run (``FullyShardedDataParallel``, gloo, CPU), the
memory events FSDP1 owns and the rate limiter's host blocks, in the order the host issues
them, to hold against ``commsim.strategies.fsdp1`` (tests/runtime/test_fsdp1_memory.py).

    RANK=r WORLD_SIZE=2 python -m runtime.fsdp1_memory_trace --init file:///tmp/rdzv \\
        --configs '[{"name": "defaults", "fsdp": {}, "checkpointing": null}]' --out trace.json

Every rank runs the configurations one after another on one process group, each as
runtime/examples/fsdp_train.py ``--fsdp1`` builds it (the catalogue's ``tiny`` model, each
``roberta.encoder.layer[i]`` wrapped, then the root; ``device_id=cpu``,
``use_orig_params=False``; Hugging Face's per-layer checkpointing outside the units when
asked; the root's lazy init run before the first step, so that units and streams are
named from the start), for ``--steps`` steps of forward and backward (each micro-step's
under ``gradient_accumulation_steps``, all but the last inside ``no_sync()`` when
``no_sync`` is set), ``AdamW.step``, ``zero_grad``; rank 0 writes the events of step
``--record-step``, run with the cyclic garbage collector off (torch 2.13 sources: RU =
_runtime_utils.py, FP = _flat_param.py, LU = _limiter_utils.py under
torch/distributed/fsdp/):

* ``flat:<unit>`` and ``mp_shard:<unit>``: ``_alloc_storage`` / ``_free_storage``
  (torch/distributed/utils.py:167-206, storage ``resize_``) on the flat parameter's
  ``_full_param_padded`` (alloc FP:1408 in ``unshard``, free FP:1821 in ``reshard``) and
  ``_mp_shard`` (alloc FP:1346 in ``pre_unshard``, free FP:1547 in ``post_unshard``),
  seen by wrapping the two functions in FP's namespace;
* every other buffer is a tensor storage: its birth is the aten op that returned it,
  seen by a ``TorchDispatchMode`` (view and in-place ops excluded), its death a
  ``weakref.finalize`` on its ``UntypedStorage`` (whose Python object lives exactly as
  long as the storage). A storage is kept only once FSDP's code names it:
  ``fgrad:<unit>`` the flat parameter's ``.grad`` at the entry of ``_post_backward_hook``
  (RU:701; autograd's ``cat`` of the parameters' gradients made it) or, when a ``.grad``
  kept from a no_sync micro-step takes it by AccumulateGrad's add, the gradient a tensor
  hook on the flat parameter sees arrive; a micro-step's buffers carry the generator's
  ``mb<i>.`` prefix,
  ``bwd.rs:<unit>.cast`` the ``.grad`` at the entry of ``_reduce_grad`` when RU:764 cast
  it, ``bwd.rs:<unit>.pad`` / ``sgrad:<unit>`` the two tensors
  ``_get_reduce_scatter_tensors`` returns (RU:890-902; the pad only if ``F.pad`` made a
  new one), ``sgrad32:<unit>`` the new storage ``_cast_grad_to_param_dtype`` (RU:1030-1056)
  gives the sharded gradient (RU:1048). The sharded gradient dies in ``zero_grad`` (set to
  None). NO_SHARD's: ``bwd.ar:<unit>.cast`` the ``.grad`` at the entry of
  ``_reduce_grad_no_shard`` when RU:764 cast it, ``grad32:<unit>`` its fp32 cast;
* ``limiter``: each ``_FreeEventQueue.dequeue_if_needed`` (LU:21-25) that returns an event,
  which RU:297-303 then ``synchronize()``s on the host; the event is named by the
  ``flat:<unit>`` free it was recorded after (``_reshard``, RU:310-330), with that free's
  phase and step (``from_step`` before ``--record-step``: carried over in the queue).

Streams: on CPU, FSDP1's device handle is ``torch.cpu``, whose ``Stream`` objects are
distinct and whose ``stream()`` context sets ``torch.cpu.current_stream()``, so each event
carries the stream current where FSDP's code issued it, named from the root's
``_default_stream`` / ``_unshard_stream`` / ``_pre_unshard_stream`` /
``_post_backward_stream`` / ``_all_reduce_stream`` as compute / unshard / pre_unshard /
post_backward / all_reduce (the all-reduce stream is the default one outside HSDP).
``pool`` is the stream a buffer was allocated on, the caching allocator pool a free returns
it to (the stream commsim's ``Free`` names); a limiter event's ``stream`` is the one its
free event was recorded on. ``phase``: fwd / bwd (inside the autograd engine, recompute
included) / opt (``AdamW.step`` and ``zero_grad``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import itertools
import json
import time
import weakref

import torch
import torch.distributed as dist
import torch.distributed.fsdp._flat_param as FP
import torch.distributed.fsdp._limiter_utils as LU
import torch.distributed.fsdp._runtime_utils as RU
from torch.utils._python_dispatch import TorchDispatchMode


class Recorder(TorchDispatchMode):
    """The events of one model's run; ``step`` set by the driver, events kept while
    ``enabled``. Install the patches (``install``) before the model's first forward."""

    def __init__(self) -> None:
        super().__init__()
        self.seq = itertools.count()
        self.events: list[dict] = []
        self.enabled = False
        self.step = -1
        self.mb = ""  # the micro-step's prefix of the generator's buffer names ("mb1." ...)
        self.no_shard = False  # inside NO_SHARD's reduction (its fp32 cast is grad32:, not sgrad32:)
        self.phase = "init"
        self.stream_names: dict[int, str] = {}
        self.unit_of_handle: dict[int, str] = {}
        self.tensor_names: dict[int, str] = {}  # id(_full_param_padded / _mp_shard) -> buffer
        self.live: dict[int, dict] = {}  # id(UntypedStorage) -> birth record
        self.named: dict[int, str] = {}  # id(UntypedStorage) -> buffer, while it lives
        self.pools: dict[str, str] = {}  # buffer -> stream it was allocated on
        self.unit: list[str] = []  # units whose FSDP code runs now (innermost last)

    # ------------------------------------------------------------ context
    def name_model(self, model: torch.nn.Module) -> None:
        """Units as commsim names them; the streams and flat-parameter tensors exist
        after the root's lazy init (``_lazy_init``, RU:112-168)."""
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        for name, m in model.named_modules():
            if isinstance(m, FSDP) and m._handle is not None:
                unit = name.replace("_fsdp_wrapped_module.", "").replace("_fsdp_wrapped_module", "") or "root"
                self.unit_of_handle[id(m._handle)] = unit
                fp = m._handle.flat_param
                for attr, kind in (("_full_param_padded", "flat"), ("_mp_shard", "mp_shard")):
                    if hasattr(fp, attr):
                        self.tensor_names[id(getattr(fp, attr))] = f"{kind}:{unit}"
        if hasattr(model, "_default_stream"):
            for attr, name in (("_all_reduce_stream", "all_reduce"), ("_default_stream", "compute"),
                               ("_unshard_stream", "unshard"), ("_pre_unshard_stream", "pre_unshard"),
                               ("_post_backward_stream", "post_backward")):
                self.stream_names[id(getattr(model, attr))] = name  # default last but one: it wins

    def cur_stream(self) -> str:
        s = torch.cpu.current_stream()
        return self.stream_names.get(id(s), f"stream@{id(s)}")

    def cur_phase(self) -> str:
        return "bwd" if torch._C._current_graph_task_id() != -1 else self.phase

    def emit(self, kind: str, buffer: str, nbytes: int, stream: str, seq: int | None = None, **extra) -> None:
        if self.enabled:
            self.events.append(dict(seq=next(self.seq) if seq is None else seq, kind=kind, buffer=buffer,
                                    bytes=nbytes, stream=stream, phase=self.cur_phase(), step=self.step, **extra))

    # ------------------------------------------------------------ storages
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view or func._schema.is_mutable:
            return out
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                self._born(t)
        return out

    def _born(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        key = id(st)
        if key in self.live or st.nbytes() == 0:
            return
        self.live[key] = dict(seq=next(self.seq), stream=self.cur_stream(), phase=self.cur_phase(),
                              step=self.step, bytes=st.nbytes())
        weakref.finalize(st, self._died, key)

    def _died(self, key: int) -> None:
        rec = self.live.pop(key, None)
        buffer = self.named.pop(key, None)
        if rec is not None and buffer is not None:
            self.emit("free", buffer, rec["bytes"], self.cur_stream(), pool=rec["stream"])

    def name_storage(self, t: torch.Tensor, buffer: str) -> None:
        """``t``'s storage is ``buffer``: its birth becomes an alloc event, its death a free."""
        key = id(t.untyped_storage())
        rec = self.live.get(key)
        if rec is None:
            raise RuntimeError(f"{buffer}: its storage was not made by an aten op seen by the recorder")
        if key in self.named:
            raise RuntimeError(f"{buffer}: the storage is already {self.named[key]}")
        self.named[key] = buffer
        self.pools[buffer] = rec["stream"]
        if self.enabled and rec["step"] == self.step:
            self.events.append(dict(seq=rec["seq"], kind="alloc", buffer=buffer, bytes=rec["bytes"],
                                    stream=rec["stream"], phase=rec["phase"], step=rec["step"], pool=rec["stream"]))

    def storage_key(self, t: torch.Tensor | None) -> int | None:
        return None if t is None else id(t.untyped_storage())


REC: list[Recorder] = []  # the active recorder (at most one)


def _rec() -> Recorder | None:
    return REC[0] if REC else None


def _handle_unit(handle) -> str:
    return _rec().unit_of_handle.get(id(handle), "?")


def install() -> None:
    """Wrap FSDP1's functions (once per process); they record only while a Recorder is active."""
    if getattr(FP, "_commsim_memory_trace", False):
        return
    FP._commsim_memory_trace = True
    alloc0, free0 = FP._alloc_storage, FP._free_storage

    def alloc_storage(tensor, size):
        r = _rec()
        was = tensor.untyped_storage().nbytes()
        alloc0(tensor, size)
        if r is not None and tensor.untyped_storage().nbytes() != was:
            buffer = r.tensor_names.get(id(tensor), f"?{tuple(tensor.shape)}")
            stream = r.cur_stream()
            r.pools[buffer] = stream
            r.emit("alloc", buffer, tensor.untyped_storage().nbytes(), stream, pool=stream)

    def free_storage(tensor):
        r = _rec()
        was = tensor.untyped_storage().nbytes()
        free0(tensor)
        if r is not None and was and not tensor.untyped_storage().nbytes():
            buffer = r.tensor_names.get(id(tensor), f"?{tuple(tensor.shape)}")
            r.emit("free", buffer, was, r.cur_stream(), pool=r.pools.get(buffer, "?"))

    FP._alloc_storage, FP._free_storage = alloc_storage, free_storage

    q_enqueue, q_dequeue = LU._FreeEventQueue.enqueue, LU._FreeEventQueue.dequeue_if_needed

    def enqueue(self, event):
        r = _rec()
        if r is not None:
            event._commsim = dict(buffer=f"flat:{r.unit[-1] if r.unit else '?'}", stream=r.cur_stream(),
                                  phase=r.cur_phase(), step=r.step)
        q_enqueue(self, event)

    def dequeue_if_needed(self):
        event = q_dequeue(self)
        r = _rec()
        if r is not None and event is not None:  # RU:297-303 synchronizes it on the host
            e = getattr(event, "_commsim", dict(buffer="?", stream="?", phase="?", step=-1))
            r.emit("limiter", e["buffer"], 0, e["stream"], freed_in=e["phase"], from_step=e["step"],
                   unsharding=r.unit[-1] if r.unit else "?")
        return event

    LU._FreeEventQueue.enqueue, LU._FreeEventQueue.dequeue_if_needed = enqueue, dequeue_if_needed

    def in_unit(fn, handle_at):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            r = _rec()
            if r is None:
                return fn(*args, **kwargs)
            r.unit.append(_handle_unit(args[handle_at]))
            try:
                return fn(*args, **kwargs)
            finally:
                r.unit.pop()
        return wrapper

    RU._unshard = in_unit(RU._unshard, 1)
    RU._reshard = in_unit(RU._reshard, 1)

    hook0 = RU._post_backward_hook

    @functools.wraps(hook0)
    def post_backward_hook(state, handle, *args, **kwargs):
        r = _rec()
        grad = None if handle is None else handle.flat_param.grad
        if r is not None and grad is not None and r.storage_key(grad) not in r.named:
            r.name_storage(grad, f"{r.mb}fgrad:{_handle_unit(handle)}")  # (else kept from no_sync micro-steps)
        return in_unit(hook0, 1)(state, handle, *args, **kwargs)

    RU._post_backward_hook = post_backward_hook  # partial'ed in each forward (RU:1450)

    reduce0 = RU._reduce_grad

    @functools.wraps(reduce0)
    def reduce_grad(state, handle):
        r = _rec()
        if r is not None:
            unit = _handle_unit(handle)
            if r.storage_key(handle.flat_param.grad) not in r.named:  # RU:764 cast it
                r.name_storage(handle.flat_param.grad, f"{r.mb}bwd.rs:{unit}.cast")
        return reduce0(state, handle)

    RU._reduce_grad = in_unit(reduce_grad, 1)

    no_shard0 = RU._reduce_grad_no_shard

    @functools.wraps(no_shard0)
    def reduce_grad_no_shard(state, handle):
        r = _rec()
        if r is None:
            return no_shard0(state, handle)
        if r.storage_key(handle.flat_param.grad) not in r.named:  # RU:764 cast it
            r.name_storage(handle.flat_param.grad, f"{r.mb}bwd.ar:{_handle_unit(handle)}.cast")
        r.no_shard = True
        try:
            return no_shard0(state, handle)
        finally:
            r.no_shard = False

    RU._reduce_grad_no_shard = in_unit(reduce_grad_no_shard, 1)

    rs0 = RU._get_reduce_scatter_tensors

    @functools.wraps(rs0)
    def get_reduce_scatter_tensors(state, unsharded_grad):
        padded, new = rs0(state, unsharded_grad)
        r = _rec()
        if r is not None:
            unit = r.unit[-1]
            if r.storage_key(padded) != r.storage_key(unsharded_grad):
                r.name_storage(padded, f"{r.mb}bwd.rs:{unit}.pad")
            r.name_storage(new, f"{r.mb}sgrad:{unit}")
        return padded, new

    RU._get_reduce_scatter_tensors = get_reduce_scatter_tensors

    cast0 = RU._cast_grad_to_param_dtype

    @functools.wraps(cast0)
    def cast_grad_to_param_dtype(state, sharded_grad, param):
        r = _rec()
        before = None if r is None else r.storage_key(sharded_grad)
        cast0(state, sharded_grad, param)
        if r is not None and r.storage_key(sharded_grad) != before:
            r.name_storage(sharded_grad, f"{r.mb}{'grad32' if r.no_shard else 'sgrad32'}:{r.unit[-1]}")

    RU._cast_grad_to_param_dtype = cast_grad_to_param_dtype


def _name_new_grad(rec: "Recorder", handle, grad: torch.Tensor) -> None:
    """A tensor hook on a flat parameter: the gradient arriving for it is ``<mb>fgrad:<unit>``
    when a ``.grad`` kept from a no_sync micro-step is there to take it (the first one,
    stolen as ``.grad``, is named in the post-backward hook)."""
    if rec.enabled and handle.flat_param.grad is not None and rec.storage_key(grad) not in rec.named:
        rec.name_storage(grad, f"{rec.mb}fgrad:{_handle_unit(handle)}")


# ---------------------------------------------------------------- the runs
SETTLE_S = 0.05  # a few OS time slices on a loaded 2-core machine


def build(settings: dict, checkpointing: str | None):
    """runtime/examples/fsdp_train.py's ``train_fsdp1`` model and optimizer."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from commsim.models import resolve_model
    from commsim.strategies.fsdp1_config import parse_fsdp1_config
    from runtime.examples.fsdp_train import fsdp1_kwargs
    from runtime.torch_models import build_model

    fc = parse_fsdp1_config(settings)
    if fc.sharding_strategy == "HYBRID_SHARD":
        raise ValueError("HYBRID_SHARD needs a device mesh: not recorded here")
    kw = fsdp1_kwargs(fc)
    torch.manual_seed(0)
    cfg = resolve_model("tiny")
    model = build_model(cfg)
    if checkpointing:
        model.gradient_checkpointing_enable(use_reentrant=checkpointing == "reentrant")
    layers = model.roberta.encoder.layer
    for i in range(len(layers)):
        layers[i] = FSDP(layers[i], **kw)
    model = FSDP(model, **kw)
    return cfg, model, torch.optim.AdamW(model.parameters(), lr=1e-4), fc


def run(settings: dict, checkpointing: str | None, steps: int, record_step: int, micro_batch: int,
        seq: int) -> dict:
    rank = dist.get_rank()
    cfg, model, opt, fc = build(settings, checkpointing)
    gas = fc.gradient_accumulation_steps
    RU._lazy_init(model, model)  # what the root's first pre-forward does: streams, flat-parameter tensors
    rec = Recorder() if rank == 0 else None
    if rec is not None:
        rec.name_model(model)
    g = torch.Generator().manual_seed(1234 + rank)
    queue_at_start = None
    if rec is not None:  # the flat gradient autograd brings, before AccumulateGrad adds it to a kept .grad
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        for m in model.modules():
            if isinstance(m, FSDP) and m._handle is not None:
                m._handle.flat_param.register_hook(functools.partial(_name_new_grad, rec, m._handle))
    for step in range(steps):
        if rec is not None:
            rec.step, rec.enabled = step, step == record_step
            if step == record_step:
                queue_at_start = len(model._free_event_queue._queue)
                gc.collect()  # no cyclic garbage freed at a random point of the recorded step:
                gc.disable()  # a storage kept by a cycle shows as never freed instead
            REC.append(rec)
            rec.__enter__()
        try:
            for micro in range(gas):
                ids = torch.randint(0, cfg.vocab, (micro_batch, seq), generator=g)
                if rec is not None:
                    rec.phase, rec.mb = "fwd", f"mb{micro}." if gas > 1 else ""
                # every micro-step but the last inside no_sync() when asked
                quiet = model.no_sync() if fc.no_sync and micro < gas - 1 else contextlib.nullcontext()
                with quiet:
                    loss = model(ids, labels=ids)
                    if rec is not None:
                        rec.phase = "bwd"
                    loss.backward()
                    del loss
            # gloo's worker thread holds each finished collective's tensors until it drops the
            # work, a moment after the caller's wait returns: let it, so that a gradient an
            # all-reduce or reduce-scatter wrote is freed where FSDP drops it, not later
            time.sleep(SETTLE_S)
            if rec is not None:
                rec.phase = "opt"
            opt.step()
            opt.zero_grad()
        finally:
            if rec is not None:
                rec.__exit__(None, None, None)
                rec.enabled = False
                gc.enable()
                REC.clear()
    dist.barrier()
    if rec is None:
        return {}
    events = sorted((e for e in rec.events if e["step"] == record_step), key=lambda e: e["seq"])
    units = {}
    for m in model.modules():
        if getattr(m, "_handle", None) is not None:
            fp = m._handle.flat_param
            padded = getattr(fp, "_padded_unsharded_size", fp.size())  # NO_SHARD has none
            units[rec.unit_of_handle[id(m._handle)]] = dict(numel=fp._unpadded_unsharded_size.numel(),
                                                            padded=padded.numel())
    return dict(events=events, queue_at_start=queue_at_start, units=units)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--init", required=True, help="init_method of the process group (file://...)")
    ap.add_argument("--configs", required=True, help='JSON list of {"name", "fsdp": {...}, "checkpointing"}')
    ap.add_argument("--out", required=True, help="rank 0 writes {name: {events, queue_at_start, units}} here")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--record-step", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=16)
    args = ap.parse_args()
    import os

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=args.init, rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]))
    if dist.get_rank() == 0:
        install()
    out = {}
    for c in json.loads(args.configs):
        out[c["name"]] = run(c.get("fsdp", {}), c.get("checkpointing"), args.steps, args.record_step,
                             args.micro_batch, args.seq)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=0)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
