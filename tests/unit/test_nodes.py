"""How ranks share the save_dir (preempt.cluster.nodes): pure decisions from what each rank saw."""

from __future__ import annotations

from preempt.cluster.nodes import Nodes, View, assign, split_by_node

SAME, OTHER_FIRST, OTHER = View(True, True), View(False, True, "its lock file is missing"), View(False, False)


def test_every_rank_sees_rank_zero_lock_file_shared():
    assert split_by_node([SAME, View(True, False), View(True, True)], mirror=False).kind == "shared"
    assert split_by_node([SAME], mirror=True).kind == "shared"


def test_a_rank_apart_without_a_mirror_is_refused_naming_it_and_what_it_saw():
    p = split_by_node([SAME, SAME, OTHER_FIRST], mirror=False)
    assert p.kind == "refused"
    assert "rank 2 does not see the save_dir as rank 0 does (its lock file is missing)" in p.problem
    assert "need a mirror" in p.problem


def test_with_a_mirror_each_other_node_is_led_by_its_first_local_rank():
    # node 0: ranks 0, 1; node 1: ranks 2, 3; node 2: ranks 4, 5
    views = [SAME, View(True, False), OTHER_FIRST, OTHER, OTHER_FIRST, OTHER]
    p = split_by_node(views, mirror=True)
    assert (p.kind, p.leaders) == ("apart", (0, 2, 4))


def test_ranks_apart_with_no_first_local_rank_are_refused():
    p = split_by_node([SAME, OTHER, OTHER], mirror=True)
    assert p.kind == "refused" and "LOCAL_RANK 0" in p.problem


def test_assign_groups_each_rank_with_the_leader_whose_lock_it_sees():
    a, b, c = {"pid": 1, "host": "n1"}, {"pid": 2, "host": "n2"}, {"pid": 3, "host": "n3"}
    got = assign([0, 2, 4], [a, b, c], [None, a, None, b, None, c])
    assert got == Nodes((0, 0, 1, 1, 2, 2), (0, 2, 4))
    assert got.count == 3 and got.ranks(1) == [2, 3] and got.leads(4) and not got.leads(5)


def test_assign_refuses_a_rank_that_sees_no_leader():
    a, b = {"pid": 1}, {"pid": 2}
    assert assign([0, 1], [a, b], [None, None, {}]) == (
        "rank 2 sees none of the node leaders' lock files in its save_dir (ranks [0, 1])"
    )
    assert isinstance(assign([0, 1], [a, b], [None, None, {"pid": 9}]), str)
