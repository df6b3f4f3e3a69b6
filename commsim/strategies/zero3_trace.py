"""The order in which DeepSpeed ZeRO-3's module hooks see submodules in one step.

DeepSpeed (deepspeed/runtime/zero/parameter_offload.py) registers a pre-forward and a
post-forward hook on every submodule, and pre-backward / post-backward hooks through
autograd; the parameter coordinator (partitioned_param_coordinator.py) records the
sequence of pre-hook calls on the first step as its trace (``__submodule_order``) and
drives prefetching from it afterwards. ``module_trace`` yields that sequence for a
model description, with layer-wise activation checkpointing re-running each layer's
forward inside backward. Stages 0-2 (zero12.py) walk the same order for the kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

from commsim.ir.errors import CommsimInputError
from commsim.ir.ops import Phase
from commsim.models.spec import ModelDescription, ModuleSpec

CHECKPOINT_STYLES = ("reentrant", "non_reentrant")


@dataclass(frozen=True, slots=True)
class TraceEntry:
    """One step of the hook sequence: fetch (a hook call), run the kernels, release."""

    module: ModuleSpec
    phase: Phase  # FORWARD, RECOMPUTE or BACKWARD
    fetch: bool = True  # a pre-forward / pre-backward hook call (a position in DeepSpeed's trace)
    run: bool = True  # the module's kernels
    release: bool = True  # its post hook (release)


def _walk(mods: list[ModuleSpec], order: list[int], phase: Phase) -> list[TraceEntry]:
    """Entries for modules visited in ``order``; a container (``encloses`` > 0) opens with
    its fetch and closes with its release once all its visited descendants are done."""
    members = set(order)
    out: list[TraceEntry] = []
    open_: list[list[int]] = []  # [container index, descendants still to visit]
    for i in order:
        m = mods[i]
        out.append(TraceEntry(m, phase, True, False, False) if m.encloses else TraceEntry(m, phase))
        for c in open_:
            if c[0] < i <= c[0] + mods[c[0]].encloses:
                c[1] -= 1
        if m.encloses:
            open_.append([i, sum(1 for j in range(i + 1, i + m.encloses + 1) if j in members)])
        while open_ and open_[-1][1] == 0:
            out.append(TraceEntry(mods[open_.pop()[0]], phase, False, False, True))
    while open_:
        out.append(TraceEntry(mods[open_.pop()[0]], phase, False, False, True))
    return out


def module_trace(md: ModelDescription, checkpointing: bool, style: str = "reentrant") -> list[TraceEntry]:
    """The order in which ZeRO-3's hooks see submodules in one forward + backward.

    Forward: pre-forward hooks in module order (containers before their children),
    post-forward hooks (releases) as each module finishes. Backward: pre-backward hooks
    in reverse order of forward completion (so a container precedes its children).
    Layer-wise checkpointing re-runs a layer's forward inside backward: ``reentrant``
    (torch.utils.checkpoint use_reentrant=True, Hugging Face's default) recomputes the
    whole layer before any of its backward hooks; ``non_reentrant`` first fires the
    pre-backward hook of the layer's last module, then recomputes (stopping early
    inside that module, whose recompute is never released), then runs the backward.
    Both orders were recorded from DeepSpeed 0.19's hooks.
    """
    if style not in CHECKPOINT_STYLES:
        raise CommsimInputError(f"checkpoint style {style!r}: allowed: {', '.join(CHECKPOINT_STYLES)}")
    mods = list(md.modules)
    # forward completion: a module finishes after those it encloses
    keys = [(i + m.encloses, -i) for i, m in enumerate(mods)]
    trace = _walk(mods, list(range(len(mods))), Phase.FORWARD)
    bwd_order = sorted(range(len(mods)), key=lambda i: keys[i], reverse=True)
    pos = 0
    while pos < len(bwd_order):
        block = mods[bwd_order[pos]].block
        if block is None or not checkpointing:
            j = pos
            while j < len(bwd_order) and (mods[bwd_order[j]].block is None or not checkpointing):
                j += 1
            trace.extend(_walk(mods, bwd_order[pos:j], Phase.BACKWARD))
            pos = j
            continue
        j = pos
        while j < len(bwd_order) and mods[bwd_order[j]].block == block:
            j += 1
        members_bwd = bwd_order[pos:j]
        members_fwd = sorted(members_bwd)
        pos = j
        if style == "reentrant":
            trace.extend(_walk(mods, members_fwd, Phase.RECOMPUTE))
            trace.extend(_walk(mods, members_bwd, Phase.BACKWARD))
            continue
        early: set[int] = set()
        for k in members_bwd:
            early.add(k)
            trace.append(TraceEntry(mods[k], Phase.BACKWARD, True, False, False))
            if mods[k].fwd or mods[k].bwd:
                break
        for e in _walk(mods, members_fwd, Phase.RECOMPUTE):
            if id(e.module) in {id(mods[k]) for k in early}:
                if e.fetch or e.run:
                    trace.append(TraceEntry(e.module, Phase.RECOMPUTE, e.fetch, e.run, False))
            else:
                trace.append(e)
        for e in _walk(mods, members_bwd, Phase.BACKWARD):
            if id(e.module) in {id(mods[k]) for k in early} and e.fetch:
                if not e.module.encloses:
                    trace.append(TraceEntry(e.module, Phase.BACKWARD, False, True, True))
            else:
                trace.append(e)
    return trace
