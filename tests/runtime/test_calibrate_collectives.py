"""How calibrate times a collective on CPUs (as a step issues it), and which groups it measures."""

import pytest

pytest.importorskip("torch")

from runtime.calibrate_collectives import INTER_NODE, INTRA_NODE, GroupSet, group_sets, in_step_mean_s  # noqa: E402


def test_one_clock_counts_from_the_last_call_to_the_last_completion():
    # two members, three calls (ns): call 0 starts at 100 / 130 and ends at 400 / 390,
    # call 1 at 1000 / 1000 -> 1200 / 5200 (one member's completion stalled), call 2
    # at 9000 / 9050 -> 9300 / 9300
    starts = [[100, 1000, 9000], [130, 1000, 9050]]
    ends = [[400, 1200, 9300], [390, 5200, 9300]]
    per_call = [400 - 130, 5200 - 1000, 9300 - 9050]
    assert in_step_mean_s(starts, ends, same_clock=True) == pytest.approx(sum(per_call) / 3 / 1e9)


def test_clocks_of_several_nodes_take_the_slowest_members_own_mean():
    starts = [[0, 10_000], [50_000, 60_000]]  # another node's clock: an offset of its own
    ends = [[300, 10_500], [50_200, 64_000]]
    assert in_step_mean_s(starts, ends, same_clock=False) == pytest.approx((200 + 4000) / 2 / 1e9)


def test_members_must_have_every_call():
    with pytest.raises(AssertionError):
        in_step_mean_s([[0, 1], [0]], [[2, 3], [2]], same_clock=True)


def test_group_sets_by_placement():
    assert group_sets(1, 1) == []
    assert group_sets(4, 4) == [GroupSet(INTRA_NODE, 4, ((0, 1, 2, 3),))]
    assert group_sets(4, 2) == [GroupSet(INTER_NODE, 4, ((0, 1, 2, 3),)),
                                GroupSet(INTRA_NODE, 2, ((0, 1), (2, 3))),
                                GroupSet(INTER_NODE, 2, ((0, 2), (1, 3)))]
