"""The host's share of the compute stream's idle windows (commsim/report/metrics.py): the
indexed block lookup gives exactly what scanning every block gives, overlapping blocks
included."""

from hypothesis import given, settings
from hypothesis import strategies as st

from commsim.report.metrics import _Blocks, _host_window
from commsim.sim.records import HostBlock


def _scan_all(blocks: list[HostBlock], a: int, b: int) -> list[tuple[int, int, str]]:
    """The window walked over every block in start order: the definition."""
    out, cur = [], a
    for hb in sorted(blocks, key=lambda h: h.start_ns):
        lo, hi = max(a, hb.start_ns), min(b, hb.end_ns)
        if hi <= lo:
            continue
        if lo > cur:
            out.append((cur, lo, "host"))
        out.append((lo, hi, hb.reason))
        cur = max(cur, hi)
    if b > cur:
        out.append((cur, b, "host"))
    return out


block = st.tuples(st.integers(0, 200), st.integers(0, 60), st.sampled_from(["host", "allocator"])).map(
    lambda t: HostBlock(t[0], t[0] + t[1], t[2]))


@settings(max_examples=300, deadline=None)
@given(st.lists(block, max_size=12), st.integers(0, 260), st.integers(0, 80))
def test_indexed_lookup_equals_scanning_every_block(blocks, a, width):
    got: list[tuple[int, int, str]] = []
    _host_window(_Blocks(blocks), a, a + width, got)
    assert got == _scan_all(blocks, a, a + width)


def test_a_long_block_before_short_ones_is_still_found():
    # the running maximum of ends, not the last block's end, decides what is skipped
    blocks = _Blocks([HostBlock(0, 100, "allocator"), HostBlock(10, 20, "host"), HostBlock(30, 40, "host")])
    assert [hb.start_ns for hb in blocks.within(50, 60)] == [0, 10, 30]
    assert blocks.within(100, 120) == [] and blocks.within(0, 0) == []
    out: list[tuple[int, int, str]] = []
    _host_window(blocks, 50, 110, out)
    assert out == [(50, 100, "allocator"), (100, 110, "host")]
