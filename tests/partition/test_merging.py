"""Joining groups of one backend: never through a node outside both, always where nothing links them."""

from __future__ import annotations

import pytest

from torchdelegate.partition.merging import Refusal, merge_groups


def test_groups_on_a_chain_through_an_outside_vertex_stay_apart_and_say_where() -> None:
    # a -> x -> b, a -> b: joining a and b would put x both before and after the group
    successors = {"a": ["x", "b"], "x": ["b"], "b": []}
    joined, refusals = merge_groups(successors, [["a"], ["b"]])
    assert joined == [[0], [1]]
    assert refusals == [Refusal(group=1, other=0, via="x")]


def test_groups_joined_by_an_edge_only_are_joined() -> None:
    successors = {"a": ["b"], "b": ["x"], "x": []}
    assert merge_groups(successors, [["a"], ["b"]]) == ([[0, 1]], [])


def test_groups_no_path_links_are_joined_and_a_join_widens_what_reaches_what() -> None:
    # p and q are independent, so they join; r, reached from p through y, cannot join them
    successors = {"p": ["y"], "q": [], "y": ["r"], "r": []}
    joined, _ = merge_groups(successors, [["p"], ["q"], ["r"]])
    assert joined == [[0, 1], [2]]


def test_every_join_keeps_the_contracted_graph_acyclic() -> None:
    # a diamond with an outside vertex x on one side: s joins t; u cannot join them, x lies between
    successors = {"s": ["x", "t"], "x": ["u"], "t": ["u"], "u": []}
    joined, refusals = merge_groups(successors, [["s"], ["t"], ["u"]])
    assert joined == [[0, 1], [2]]
    assert refusals == [Refusal(group=2, other=0, via="x")]


def test_groups_that_already_form_a_cycle_are_refused() -> None:
    # a -> x -> c with a and c in one group: contracted, the group both feeds x and is fed by it
    successors = {"a": ["x"], "x": ["c"], "c": []}
    with pytest.raises(ValueError, match=r"merge_groups: the groups do not contract to an acyclic graph"):
        merge_groups(successors, [["a", "c"]])
