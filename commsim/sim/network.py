"""Links whose bandwidth concurrent transfers share (a fluid model).

A transfer is a set of byte demands on links (``costs.Link``). While several transfers
cross a link, each gets an equal share of its capacity; a transfer progresses at the
rate of its tightest link. Every start, end or capacity change settles the progress
made so far and re-plans the rates, and one timer wakes the network at the soonest
completion. Capacities come from a callback, so the simulator can slow a node's links
while that node computes.
"""

from __future__ import annotations

from math import ceil
from typing import Callable

import simpy

from commsim.hardware.links import Link


class _Transfer:
    __slots__ = ("demands", "remaining", "rate", "event")

    def __init__(self, demands: tuple[tuple[Link, float], ...], event: simpy.Event):
        self.demands = demands
        self.remaining = 1.0  # the fraction still to move
        self.rate = 0.0  # fraction per ns
        self.event = event


class FluidNetwork:
    """Links with bandwidth shared equally between the transfers crossing them."""

    def __init__(self, env: simpy.Environment, capacity: Callable[[Link], float]):
        self.env = env
        self.capacity = capacity  # bytes per second of a link, now
        self.active: list[_Transfer] = []
        self.users: dict[Link, int] = {}
        self.last = 0
        self.generation = 0

    def start(self, demands: tuple[tuple[Link, float], ...]) -> simpy.Event:
        """Begin moving ``demands`` (link, bytes); the event fires when all have moved."""
        ev = self.env.event()
        demands = tuple((l, b) for l, b in demands if b > 0)
        if not demands:
            ev.succeed()
            return ev
        self._advance()
        t = _Transfer(demands, ev)
        self.active.append(t)
        for l, _ in demands:
            self.users[l] = self.users.get(l, 0) + 1
        self._reschedule()
        return ev

    def refresh(self) -> None:
        """Capacities changed: settle progress so far, then re-plan the rates."""
        if self.active:
            self._advance()
            self._reschedule()

    def throughput(self, link: Link) -> float:
        """Bytes per second the active transfers move over ``link`` now."""
        total = 0.0
        for t in self.active:
            for l, b in t.demands:
                if l == link:
                    total += t.rate * b * 1e9
        return total

    def _advance(self) -> None:
        dt = self.env.now - self.last
        if dt:
            for t in self.active:
                t.remaining -= t.rate * dt
        self.last = self.env.now

    def _reschedule(self) -> None:
        self.generation += 1
        if not self.active:
            return
        soonest = None
        for t in self.active:
            # progress per ns: the tightest link's share of bandwidth over its bytes
            t.rate = min(self.capacity(l) / self.users[l] / b for l, b in t.demands) / 1e9
            eta = t.remaining / t.rate
            soonest = eta if soonest is None or eta < soonest else soonest
        gen = self.generation
        wake = self.env.timeout(max(0, ceil(soonest - 1e-6)))
        wake.callbacks.append(lambda _ev, gen=gen: self._wake(gen))

    def _wake(self, gen: int) -> None:
        if gen != self.generation:  # a later re-plan superseded this timer
            return
        self._advance()
        done = [t for t in self.active if t.remaining <= 1e-9 * max(1.0, t.rate)]
        if not done:  # rounding: finish the closest one
            done = [min(self.active, key=lambda t: t.remaining)]
        for t in done:
            self.active.remove(t)
            for l, _ in t.demands:
                self.users[l] -= 1
            t.event.succeed()
        self._reschedule()
