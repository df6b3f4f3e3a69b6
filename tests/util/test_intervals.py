"""commsim.util.intervals: unions, lengths, uncovered time and overlap, exactly."""

from commsim.util.intervals import length, overlap, uncovered, union


def test_union_merges_touching_and_nested_and_drops_empty():
    assert union([(5, 9), (0, 2), (2, 3), (6, 7), (10, 10), (12, 11)]) == [(0, 3), (5, 9)]


def test_length_uncovered_and_overlap():
    comm = [(0, 10), (20, 30), (25, 40)]  # union (0, 10), (20, 40): 30
    comp = [(5, 22), (35, 36), (50, 60)]
    assert length(comm) == 30
    assert uncovered(comm, comp) == 5 + 13 + 4  # (0,5), (22,35), (36,40)
    assert overlap(comm, comp) == 30 - 22
    assert uncovered(comm, []) == 30 and overlap(comm, []) == 0 and uncovered([], comp) == 0
