"""A rank's step on a CPU platform (kernels inline on the host thread; gloo).

As frameworks run on CPUs: a kernel executes on the host thread when the host reaches
it, once its dependencies and the previous op of its stream are done (a CPU has no
device queue). A collective whose inputs are ready when the host reaches it is issued by
the host thread itself, as a framework's Python issues it; one that must wait goes to an
issuer thread of its stream (keeping stream order without blocking the host). Either
way collectives reach the backend in program order (a ticket), so every rank issues
them in the same order, as gloo's matching by call order needs. A collective ends when
the first thread sees it complete: its done-callback on the backend's thread, or a
thread waiting on it (``_Done``); one whose work has no future (gloo's reduce-scatter)
is watched by its stream's issuer thread. Times are the host's monotonic clock, in ns.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from commsim.ir import ops as O
from commsim.ir.trace import HOST_STREAM, TraceRecord
from runtime.kernels import spin_ns
from runtime.step import ExecutionError, op_record

if TYPE_CHECKING:
    from runtime.executor import RankExecutor


class _Done:
    """An op's completion on a CPU rank. A thread that waits for a collective waits on
    the backend's work itself where it has one, so it wakes when the backend completes
    the work, not after the done-callback's own wake-up (a hand-off that costs a thread
    wake-up, long on a busy machine). The op's end is the first moment any thread saw it
    complete, so that nothing that waited for it starts before it ends."""

    __slots__ = ("event", "work", "end_ns")
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.event = threading.Event()  # set once the op is done and checked
        self.work: Any = None
        self.end_ns: int | None = None

    def set(self) -> None:
        self.event.set()

    def seen(self) -> None:
        """A thread saw the op complete, now."""
        t = time.perf_counter_ns()
        with self._lock:
            if self.end_ns is None or t < self.end_ns:
                self.end_ns = t

    def is_set(self) -> bool:
        work = self.work
        if self.event.is_set():
            return True
        if work is not None and work.is_completed():
            self.seen()
            return True
        return False

    def wait(self) -> None:
        work = self.work
        if work is not None and not self.event.is_set():
            try:
                work.wait()
            except BaseException:  # noqa: BLE001 - the done-callback records the error
                self.event.wait()
                return
            self.seen()
            return
        self.event.wait()


class CpuRank:
    """The CPU behaviour of one rank: what lasts across steps (each collective's ticket,
    the collective kinds whose works have no future); each step is a ``_CpuStep``."""

    def __init__(self, ex: RankExecutor):
        self.ex = ex
        colls = [op for op in ex.program.step if isinstance(op, O.Collective)]
        self.coll_index = {op.id: i for i, op in enumerate(colls)}
        self.no_future: set[O.CollectiveKind] = set()  # the backend's works of these kinds have none

    def setup(self) -> None:
        for op in self.ex.program.setup:
            self.ex._alloc(op)

    def run_step(self) -> tuple[int, list[TraceRecord]]:
        return _CpuStep(self.ex, self.coll_index, self.no_future).run()


# An issuer thread's queue item: ("issue", op, its completion, the stream's previous
# collective's) or ("wait", op, its completion, (issue time, check, the work's wait));
# None ends the thread.
_Item = tuple[str, O.Collective, _Done, Any]


class _CpuStep:
    """One step's state on a CPU rank, and the host thread, issuer threads and backend
    callbacks that share it. Its methods refer to one another through ``self`` rather
    than as closures over each other, and nothing the step hands out refers back to it
    once its threads have ended and its collectives' works are dropped, so the whole
    step is freed by reference counting when ``run`` returns. (A cycle would leave its
    events and threads to the garbage collector, whose passes then grow and run inside
    whichever op allocates next, slowing large allocations.)"""

    def __init__(self, ex: RankExecutor, coll_index: dict[O.OpId, int], no_future: set[O.CollectiveKind]):
        self.ex = ex
        self.coll_index = coll_index
        self.no_future = no_future
        self.done: dict[O.OpId, _Done] = {}
        self.last_on: dict[str, _Done] = {}  # stream -> its last op's completion
        self.records: list[TraceRecord] = []
        self.lock = threading.Lock()
        self.issued = 0  # collectives handed to the backend so far (the ticket being served)
        self.issue_cv = threading.Condition()
        self.errors: list[BaseException] = []
        self.issuers: dict[str, tuple[list[_Item | None], threading.Condition]] = {}  # stream -> queue, condition
        self.threads: list[threading.Thread] = []
        self.finished: list[tuple[_Done, str, O.Collective, int]] = []  # (completion, stream, op, issue time)

    def _failed(self, op: O.Op, e: BaseException) -> None:
        self.errors.append(e if isinstance(e, ExecutionError) else self.ex.fail(op, e))

    def finish(self, op: O.Collective, stream: str, start: int, ev: _Done, check: Any,
               wait: Callable[[], Any]) -> None:
        """Record a collective once ``wait()`` (which raises the backend's error: a
        timeout, a dead peer) has returned, and wake whoever waits for it."""
        try:
            wait()
            ev.seen()
            ev.work = None  # the work holds its tensors: let a freed buffer's memory go
            if check is not None:
                check()
            with self.lock:
                self.finished.append((ev, stream, op, start))
        except BaseException as e:  # noqa: BLE001 - re-raised on the host with the op named
            self._failed(op, e)
            with self.issue_cv:
                self.issue_cv.notify_all()
        finally:
            ev.set()

    def issue(self, op: O.Collective, stream: str, ev: _Done, on_issuer: bool) -> None:
        """Hand the collective to the backend once every earlier one has been (its
        ticket), then watch for its completion: a done-callback on the backend's
        thread where the work has a future (it wakes the waiter directly), else a
        wait on the stream's issuer thread (gloo's reduce-scatter has no future)."""
        with self.issue_cv:
            while self.issued != self.coll_index[op.id] and not self.errors:
                self.issue_cv.wait(0.05)
            if self.errors:
                ev.set()
                return
            start = time.perf_counter_ns()
            try:
                work, check = self.ex.collective(op)
                ev.work = work
            except BaseException:
                ev.set()  # never issued: nobody may wait for it (the step's end waits for all)
                raise
            finally:
                self.issued += 1
                self.issue_cv.notify_all()
        fut = None
        if op.kind not in self.no_future:
            try:
                fut = work.get_future()
            except RuntimeError:  # "Work::getFuture not implemented"
                self.no_future.add(op.kind)
        if fut is None:
            if on_issuer:
                self.finish(op, stream, start, ev, check, work.wait)
            else:
                self.enqueue(stream, ("wait", op, ev, (start, check, work.wait)))
            return
        fut.add_done_callback(lambda f: self.finish(op, stream, start, ev, check, f.value))

    def issuer(self, stream: str, items: list[_Item | None], cv: threading.Condition) -> None:
        """An issuer thread of ``stream``: issues its queued collectives in order, each
        once the stream's previous one and its deps are done, and waits for those whose
        works have no future. Each item is served in a frame of its own (``serve``) and
        dropped before the thread waits for the next: a waited item holds the work's
        ``wait``, so the work and the tensors it keeps (gloo's reduce-scatter: its input
        and its clone of it) would otherwise live until the stream's next collective,
        after the schedule freed the buffer (the last one of a step: until the step's
        end, so a large block's pages came back to the OS late)."""
        while True:
            with cv:
                while not items:
                    cv.wait()
                item = items.pop(0)
            if item is None:
                return
            self.serve(stream, item)
            item = None

    def serve(self, stream: str, item: _Item) -> None:
        """One item of ``stream``'s issuer: wait for a collective, or issue one."""
        what, op, ev, arg = item
        if what == "wait":
            start, check, wait = arg
            self.finish(op, stream, start, ev, check, wait)
            return
        try:
            if arg is not None:  # the stream's previous collective
                arg.wait()
            for d in op.deps:
                self.done[d].wait()
            if self.errors:
                ev.set()
                return
            self.issue(op, stream, ev, True)
        except BaseException as e:  # noqa: BLE001 - re-raised on the host with the op named
            self._failed(op, e)
            ev.set()
            with self.issue_cv:
                self.issue_cv.notify_all()

    def enqueue(self, stream: str, item: _Item | None) -> None:
        """Queue ``item`` for ``stream``'s issuer thread, started on first use."""
        if stream not in self.issuers:
            queue: list[_Item | None] = []
            cv = threading.Condition()
            th = threading.Thread(target=self.issuer, args=(stream, queue, cv), daemon=True)
            self.issuers[stream] = (queue, cv)
            self.threads.append(th)
            th.start()
        items, cv = self.issuers[stream]
        with cv:
            items.append(item)
            cv.notify()

    def _record_host(self, op: O.Op, start: int) -> None:
        """Record a host op that ran from ``start`` until now."""
        with self.lock:
            self.records.append(op_record(self.ex.rank, HOST_STREAM, op, start, time.perf_counter_ns()))

    def _host_sync(self, op: O.HostSync) -> None:
        if op.scope is O.SyncScope.OPS:
            evs = [self.done[d] for d in op.deps]
        elif op.scope is O.SyncScope.STREAM:
            evs = [self.last_on[op.stream]] if op.stream in self.last_on else []
        else:
            evs = list(self.last_on.values())
        for e in evs:
            e.wait()

    def _collective(self, op: O.Collective) -> None:
        """From the host thread: issue ``op`` now when nothing is in its way, else hand
        it to its stream's issuer thread."""
        ev = _Done()
        prev = self.last_on.get(op.stream)
        self.done[op.id] = ev
        self.last_on[op.stream] = ev
        if ((prev is None or prev.is_set()) and all(self.done[d].is_set() for d in op.deps)
                and self.issued == self.coll_index[op.id]):
            # nothing to wait for: issue it from the host thread, as a framework's
            # Python does (a hand-off to a thread costs wake-ups)
            try:
                self.issue(op, op.stream, ev, False)
            except ExecutionError:
                raise
            except BaseException as e:  # noqa: BLE001
                raise self.ex.fail(op, e) from e
            return
        self.enqueue(op.stream, ("issue", op, ev, prev))

    def _kernel(self, op: O.Compute | O.Copy) -> bool:
        """Run a compute or copy op on the host thread, in stream order; False if an
        error elsewhere ended the step while it waited."""
        ex = self.ex
        prev = self.last_on.get(op.stream)
        if prev is not None:
            prev.wait()
        for d in op.deps:
            self.done[d].wait()
        if self.errors:
            return False
        start = time.perf_counter_ns()
        try:
            ex.kernels.execute(op)
        except BaseException as e:  # noqa: BLE001
            raise ex.fail(op, e) from e
        end = time.perf_counter_ns()
        ev = _Done()
        ev.set()
        self.done[op.id] = ev
        self.last_on[op.stream] = ev
        with self.lock:
            self.records.append(op_record(ex.rank, op.stream, op, start, end))
        return True

    def run(self) -> tuple[int, list[TraceRecord]]:
        ex = self.ex
        t0 = time.perf_counter_ns()
        try:
            for op in ex.program.step:
                if self.errors:
                    break
                ex.note(op)
                start = time.perf_counter_ns()
                if isinstance(op, O.HostWork):
                    spin_ns(op.duration_ns)
                elif isinstance(op, O.HostSync):
                    self._host_sync(op)
                elif isinstance(op, O.Alloc):
                    ex._alloc(op)
                elif isinstance(op, O.Free):
                    ex.buffers.pop(op.buffer, None)
                    continue
                elif isinstance(op, O.Collective):
                    self._collective(op)
                    continue
                else:
                    if not self._kernel(op):
                        break
                    continue
                self._record_host(op, start)
        finally:
            for stream in list(self.issuers):
                self.enqueue(stream, None)
            for th in self.threads:
                th.join()
            for ev in self.done.values():  # every collective done (its watcher has run)
                ev.event.wait()
        for ev, stream, op, start in self.finished:
            assert ev.end_ns is not None
            self.records.append(op_record(ex.rank, stream, op, start, ev.end_ns))
        if self.errors:
            raise self.errors[0]
        return t0, self.records
