from torchdelegate.partition.components import components


def test_pairs_join_units_into_sorted_groups_in_the_order_of_their_first_units() -> None:
    assert components([5, 1, 3, 2, 4], [(4, 2), (5, 1)]) == [[1, 5], [2, 4], [3]]
    assert components(range(4), [(0, 1), (1, 2), (2, 3)]) == [[0, 1, 2, 3]]
    assert components([], []) == []
