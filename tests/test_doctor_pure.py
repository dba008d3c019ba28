"""Tier 1, with no process started: the doctor's link checks (cli/doctor.py)."""

from __future__ import annotations


def test_the_doctor_s_link_matrix_names_each_pair_that_cannot_connect():
    from launcher.cli.doctor import link_matrix

    ips, ifaces = ["10.0.0.9", "10.0.0.10"], ["ens5", None]
    table, failed = link_matrix(ips, ifaces, [[None, None], ["no answer within 3 s", None]])
    assert table.splitlines()[1].split() == ["0", "10.0.0.9", "ens5", "-", "ok"]
    assert table.splitlines()[2].split() == ["1", "10.0.0.10", "?", "FAIL", "-"]
    assert failed == [
        "node 1 (10.0.0.10, ?) cannot reach node 0 (10.0.0.9, ens5) on the rendezvous ports: no answer "
        "within 3 s"
    ]


def test_the_doctor_checks_every_link_of_a_small_cluster_and_a_few_per_node_of_a_large_one():
    from launcher.cli.doctor import MATRIX_NODES, link_targets

    small = link_targets(4, every_pair=False)
    assert small == [[1, 2, 3], [0, 2, 3], [0, 1, 3], [0, 1, 2]]
    large = link_targets(1024, every_pair=False)
    assert sum(map(len, large)) == 3 * 1024  # not 1024 x 1023
    assert large[0] == [1, 2, 512] and large[1023] == [0, 1, 511]
    halves = {(i, j) for i, row in enumerate(large) for j in row if (i < 512) != (j < 512)}
    assert halves  # a split of the nodes into two halves is crossed
    assert len(link_targets(MATRIX_NODES + 1, every_pair=True)[0]) == MATRIX_NODES
