"""The host time of DeepSpeed ZeRO-3's hook plumbing: what a step pays around the timed
routines, per module hook call, timed on this machine's CPU for ``runtime.ds_host_costs``.

``ds_host_costs`` times the routines a module hook calls (the fetch and release paths,
the gradient hook, the flush). Around them, every module's forward and backward runs
more of DeepSpeed's Python that no routine holds: PyTorch calling the registered
forward pre- and post-hooks, the hook functions themselves, ``_apply_to_tensors_only``
wrapping each module's inputs and outputs in the autograd Functions whose backward
fires the backward hooks (PreBackwardFunction / PostBackwardFunction), those Functions'
``forward`` and ``backward``, and, from 0.6.0, ``ZeROOrderedDict.__getitem__`` at every
parameter access. That is the plumbing, measured by difference over the forward +
backward of a step (from the model's ``forward`` call to the return of
``loss.backward()``):

    plumbing = (window - the timed routines inside it) - the same model's plain forward
               + backward (no DeepSpeed) - the Recorder's own cost per wrapped call

with each term's minimum over the steady-state steps (the thread's CPU time; a plain
step runs after each DeepSpeed step, so both see the same minutes of this machine), and
divided by the module hook calls (fetch and release) in the window. The tensors are the
same shapes in both (a gathered parameter is full-sized), so their ops cancel.
"""

from __future__ import annotations

import statistics
from typing import Any, Callable

from runtime.ds_host_timing import Recorder, clock

# the Recorder's own wrapper measured over this many calls (each module of the plain
# model, repeated), best of REPEATS
OVERHEAD_ROUNDS, OVERHEAD_REPEATS = 20, 7


class ForwardBackwardWindow:
    """Times the forward + backward part of one step of ``module`` (its ``forward``
    called, until ``loss.backward()`` returns), with the Recorder's calls inside it."""

    def __init__(self, torch: Any, module: Any, rec: Recorder):
        self.torch, self.module, self.rec = torch, module, rec
        self.elapsed_ns = self.routines_ns = 0
        self.calls: dict[str, int] = {}

    def run(self, step: Callable[[], None]) -> None:
        torch, rec, module = self.torch, self.rec, self.module
        marks: dict[str, Any] = {}
        forward, backward = module.forward, torch.Tensor.backward

        def snapshot() -> dict[str, int]:
            return {k: len(v) for k, v in rec.calls.items()}

        def timed_forward(*a, **k):
            if "t0" not in marks:  # the first call: reentrant checkpointing calls it again
                marks["n0"], marks["t0"] = snapshot(), clock()
            return forward(*a, **k)

        def timed_backward(t, *a, **k):
            out = backward(t, *a, **k)
            marks["t1"], marks["n1"] = clock(), snapshot()
            return out

        own = vars(module).get("forward")  # an instance attribute to put back, or none
        module.forward, torch.Tensor.backward = timed_forward, timed_backward
        try:
            step()
        finally:
            torch.Tensor.backward = backward
            if own is None:
                del module.forward
            else:
                module.forward = own
        assert "t1" in marks, "the step never called loss.backward()"
        n0, n1 = marks["n0"], marks["n1"]
        self.elapsed_ns = marks["t1"] - marks["t0"]
        self.calls = {k: n1[k] - n0.get(k, 0) for k in n1}
        self.routines_ns = sum(t for k, v in rec.calls.items() for t, _ in v[n0.get(k, 0):n1.get(k, 0)])


def plain_step_ns(torch: Any, model: Any, vocab: int) -> int:
    """One forward + backward of ``model`` without DeepSpeed (the same input shape as
    the releases' steps), thread CPU time."""
    ids = torch.randint(0, vocab, (2, 16))
    t0 = clock()
    loss = model(ids, ids)
    loss.backward()
    dt = clock() - t0
    for p in model.parameters():
        p.grad = None
    return dt


def wrapper_overhead_ns(model: Any) -> float:
    """The Recorder's cost per wrapped call outside the window it times (its counters,
    the features function), with the fetch hook's features over a real module."""

    def n_params(args):
        return {"param": len(list(args[0].named_parameters(recurse=False)))}

    def noop(m):
        return None

    mods = list(model.modules()) * OVERHEAD_ROUNDS
    best_wrapped = best_bare = float("inf")
    for _ in range(OVERHEAD_REPEATS):
        rec = Recorder()
        wrapped = rec.wrap("x", noop, n_params)
        t0 = clock()
        for m in mods:
            wrapped(m)
        best_wrapped = min(best_wrapped, clock() - t0)
        t0 = clock()
        for m in mods:
            noop(m)
        best_bare = min(best_bare, clock() - t0)
    return max(0.0, (best_wrapped - best_bare) / len(mods))


def plumbing(untimed_ns: list[int], plain_ns: list[int], calls: dict[str, int], overhead_ns: float) -> dict:
    """Per module hook call, from each steady step's window less its routines
    (``untimed_ns``) and each plain step (``plain_ns``); ``calls``: the wrapped calls of
    one step's window, by routine. The figure is the minima's difference; the median of
    each step's own difference (its plain step right after it) is kept beside it, with
    the steps, so that other estimators can be judged on stored runs."""
    hooks = calls.get("fetch", 0) + calls.get("release", 0)
    wrapped = sum(calls.values())
    assert hooks > 0, "no module hook ran in the window"
    total = min(untimed_ns) - min(plain_ns) - overhead_ns * wrapped
    paired = statistics.median(u - p for u, p in zip(untimed_ns, plain_ns)) - overhead_ns * wrapped
    return {"per_hook_call_ns": max(0, round(total / hooks)), "paired_per_hook_call_ns": max(0, round(paired / hooks)),
            "untimed_ns": min(untimed_ns), "plain_ns": min(plain_ns), "wrapper_ns": round(overhead_ns),
            "wrapped_calls": wrapped, "hook_calls": hooks, "untimed_steps_ns": list(untimed_ns),
            "plain_steps_ns": list(plain_ns)}
