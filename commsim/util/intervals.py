"""Time intervals ``(start, end)`` in nanoseconds: their union, its length, and how much
of one set another leaves uncovered (busy time, exposed communication, overlap)."""

from __future__ import annotations

from typing import Iterable

Interval = tuple[int, int]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """The union as sorted, disjoint intervals (empty ones dropped)."""
    out: list[Interval] = []
    for a, b in sorted(intervals):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def length(intervals: Iterable[Interval]) -> int:
    """The length of the union."""
    return sum(b - a for a, b in union(intervals))


def uncovered(a: Iterable[Interval], b: Iterable[Interval]) -> int:
    """The length of union(a) minus union(b): time in ``a`` while nothing of ``b`` runs."""
    ua, ub = union(a), union(b)
    total, j = 0, 0
    for s, e in ua:
        cur = s
        while j < len(ub) and ub[j][1] <= cur:
            j += 1
        k = j
        while k < len(ub) and ub[k][0] < e:
            if ub[k][0] > cur:
                total += ub[k][0] - cur
            cur = max(cur, ub[k][1])
            k += 1
        if cur < e:
            total += e - cur
    return total


def overlap(a: Iterable[Interval], b: Iterable[Interval]) -> int:
    """The length of union(a) intersected with union(b)."""
    ua = union(a)
    return length(ua) - uncovered(ua, b)
