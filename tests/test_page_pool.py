"""bench/page_pool.py: how much freed memory the guest serves fast (its pure parts, and
a machine without page reporting)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import page_pool as pp  # noqa: E402


def test_the_fast_prefix_ends_at_the_first_reported_piece():
    assert pp.fast_prefix_mib([False, False, True, False]) == 128  # two 64 MiB pieces
    assert pp.fast_prefix_mib([True, False]) == 0
    assert pp.fast_prefix_mib([False] * 3) == 192


def test_a_touch_line_counts_fast_and_reported_pieces():
    assert pp.line("first touch", [0.8, 0.9, 3.5, 0.8], [False, False, True, False]) == (
        "first touch: 128 MiB fast before the first reported piece, 64 MiB reported of 256 "
        "[0.8 0.9 3.5 0.8 ns/B]")


def test_a_machine_that_reports_nothing_is_not_probed(monkeypatch, capsys):
    monkeypatch.setattr(pp, "balloon_reports", lambda: False)
    monkeypatch.setattr(pp, "touch", lambda n: (_ for _ in ()).throw(AssertionError("touched")))
    monkeypatch.setattr(sys, "argv", ["page_pool.py", "--mib", "64"])
    pp.main()
    assert capsys.readouterr().out == ("this machine's kernel reports no free memory to a host: "
                                       "every freed page comes back fast\n")
