"""Every garbage collection of a training script's rank, with where in the program it fell.

    --gc-log PREFIX        time every collection and write PREFIX.rank<N>.json at the end
    --gc-threshold T0,T1,T2  gc.set_threshold before the first step

Used by ``ds_train`` and ``fsdp_train``; ``bench/gc_alignment.py`` reads the files to
tell whether the ranks' collectors run at the same points of the step (commsim's
``--host-gc`` aligned / independent).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--gc-log", metavar="PREFIX",
                    help="time every garbage collection of every rank and write PREFIX.rank<N>.json: per collection "
                    "its generation, step, phase, module-hook count (the program position) and pause, and for "
                    "the older generations the objects examined and surviving (bench/gc_alignment.py reads them)")
    ap.add_argument("--gc-threshold", metavar="T0,T1,T2",
                    help="gc.set_threshold(T0, T1, T2) before the first step (CPython's default 700,10,10): lower "
                    "ones make a short run collect as often as a long run of a large model does")


def start(args: argparse.Namespace, model) -> "GcLog | None":
    """Apply ``--gc-threshold`` and, with ``--gc-log``, start logging ``model``'s rank."""
    if args.gc_threshold:
        gc.set_threshold(*(int(x) for x in args.gc_threshold.split(",")))
    return GcLog(model) if args.gc_log else None


class GcLog:
    """Every garbage collection of this process: its generation, the step and phase it
    fell in, the module hooks run so far (the program position: identical programs
    collect at the same count) and its pause, timed by ``gc.callbacks``; for the older
    generations also the objects examined and those that survived (a generation-1
    pass's survivors are the objects promoted to the oldest generation)."""

    def __init__(self, model) -> None:
        self.step, self.phase, self.hooks = -1, "setup", 0
        self.events: list[dict] = []
        self._start = 0.0
        self._examined: int | None = None
        for mod in model.modules():
            mod.register_forward_pre_hook(self._hook)
            mod.register_full_backward_pre_hook(self._hook)
        gc.callbacks.append(self._callback)

    def begin_step(self, step: int) -> None:
        self.step = step

    def _hook(self, *_args) -> None:
        self.hooks += 1

    def _callback(self, what: str, info: dict) -> None:
        gen = info["generation"]
        if what == "start":
            # the objects this collection examines (counted for the older generations
            # only: a young one runs several times a step): a generation-1 pass promotes
            # its survivors to the oldest generation, a full pass visits every object
            self._examined = sum(len(gc.get_objects(g)) for g in range(gen + 1)) if gen else None
            self._start = time.perf_counter()
            return
        ev = {"generation": gen, "step": self.step, "phase": self.phase, "hooks": self.hooks, "at_s": self._start,
              "pause_s": time.perf_counter() - self._start, "collected": info["collected"]}
        if self._examined is not None:
            ev["examined"] = self._examined
            ev["survivors"] = self._examined - info["collected"]
        self.events.append(ev)

    def write(self, path: str, step_times_s: list[float]) -> None:
        gc.callbacks.remove(self._callback)
        with open(path + ".tmp", "w") as f:
            json.dump({"events": self.events, "step_times_s": step_times_s, "threshold": list(gc.get_threshold())}, f)
        os.replace(path + ".tmp", path)
