"""Tier 1, with no process started: node order, rank numbering, visible devices and master ports
(core/topology.py)."""

from __future__ import annotations

import pytest

from launcher.core.topology import (
    NodeSlot,
    assign_ranks,
    candidate_ports,
    format_rank_ranges,
    order_nodes,
    visible_devices,
)


def test_ips_sort_numerically_not_as_strings():
    nodes = [
        NodeSlot(0, "10.0.0.10", "a"),
        NodeSlot(1, "10.0.0.9", "b"),
        NodeSlot(2, "10.0.0.100", "c"),
        NodeSlot(3, "9.1.1.1", "d"),
    ]
    assert [n.node_ip for n in order_nodes(nodes)] == ["9.1.1.1", "10.0.0.9", "10.0.0.10", "10.0.0.100"]


def test_same_ip_breaks_ties_by_node_id_and_hostnames_go_last():
    nodes = [
        NodeSlot(0, "127.0.0.1", "ff"),
        NodeSlot(1, "node-b", "00"),
        NodeSlot(2, "127.0.0.1", "0a"),
        NodeSlot(3, "::1", "11"),
    ]
    assert [(n.node_ip, n.node_id) for n in order_nodes(nodes)] == [
        ("127.0.0.1", "0a"),
        ("127.0.0.1", "ff"),
        ("::1", "11"),
        ("node-b", "00"),
    ]


def test_ranks_are_contiguous_per_node_in_node_order():
    slots = assign_ranks(order_nodes([NodeSlot(0, "10.0.0.2", "x"), NodeSlot(1, "10.0.0.1", "y")]), 3)
    assert [(s.rank, s.node_rank, s.local_rank, s.group, s.bundle) for s in slots] == [
        (0, 0, 0, 1, 0),
        (1, 0, 1, 1, 1),
        (2, 0, 2, 1, 2),
        (3, 1, 0, 0, 0),
        (4, 1, 1, 0, 1),
        (5, 1, 2, 0, 2),
    ]
    assert {s.node_ip for s in slots[:3]} == {"10.0.0.1"}


def test_visible_devices_lets_local_rank_select_the_ray_gpu():
    ids = [["3"], ["1"], ["6"]]  # what Ray gave the ranks of one node, by local rank
    cvd = visible_devices(ids)
    assert cvd == "3,1,6"
    for local_rank, own in enumerate(ids):
        assert cvd.split(",")[local_rank] == own[0]


def test_visible_devices_rejects_inconsistent_assignments():
    assert visible_devices([[], []]) == ""
    with pytest.raises(ValueError, match="same GPU"):
        visible_devices([["0"], ["0"]])
    with pytest.raises(ValueError, match="expected one"):
        visible_devices([["0", "1"]])
    with pytest.raises(ValueError, match="1 of 2 ranks"):
        visible_devices([["0"], []])


def test_format_rank_ranges():
    assert format_rank_ranges([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"


def test_port_candidates_depend_on_the_job_and_avoid_the_ephemeral_range():
    a = list(candidate_ports("job-a", 20000, 20100, exclude=(20050, 20099)))
    assert sorted(a) == list(range(20000, 20050))
    assert a == list(candidate_ports("job-a", 20000, 20100, exclude=(20050, 20099)))
    assert a != list(candidate_ports("job-b", 20000, 20100, exclude=(20050, 20099)))


def test_groups_sharing_a_node_are_all_found_in_one_pass():
    from launcher.core.placing import sort_out

    assert sort_out(set(), [(0, "a"), (1, "b"), (2, "c")]) == ([0, 1, 2], [])
    # placed again together, in one round: on a node held before, or by an earlier one of these
    assert sort_out({"z"}, [(0, "a"), (1, "a"), (2, "b"), (3, "z"), (4, "b")]) == ([0, 2], [1, 3, 4])


def test_placing_waits_at_most_10_s_on_a_cluster_that_cannot_grow():
    """What the restart line says it waits is what placing waits (it said 120 s on `megaray up`)."""
    from launcher.core.launch_args import spec_from_args
    from launcher.driver.gang.placement import wait_s

    spec = spec_from_args(["--dry-run"])
    assert (wait_s(spec, fixed_size=True), wait_s(spec, fixed_size=False)) == (10.0, 120.0)
    short = spec_from_args(["--placement-timeout", "5", "--dry-run"])
    assert wait_s(short, fixed_size=True) == 5.0


def test_placing_waits_its_whole_timeout_where_the_room_is_free_on_a_cluster_that_cannot_grow():
    """Session 42: a dry run on a Ray started for it was refused after 10 s, 'GPU 2/2 free, CPU 2/2
    free', its placement slow on a loaded machine: the cap is for room another job holds."""
    from launcher.core.placing import room_wait_s

    assert room_wait_s(120, fixed_size=True, free_fit=2, needed=2, cap_s=10) == 120
    assert room_wait_s(120, fixed_size=True, free_fit=1, needed=2, cap_s=10) == 10  # one node held
    assert room_wait_s(5, fixed_size=True, free_fit=0, needed=1, cap_s=10) == 5
    assert room_wait_s(120, fixed_size=False, free_fit=0, needed=2, cap_s=10) == 120  # it can grow


def test_a_relaunch_that_cannot_fit_says_the_minimum_of_the_node_range_it_needed():
    """#46: below MIN after a lost node, the error said '3 node(s)' of --nodes 2:3, the 2 needed unsaid."""
    import dataclasses

    from launcher.core.launch_args import spec_from_args
    from launcher.driver.gang.placement import describe_request

    spec = spec_from_args(["--nodes", "2:3", "--device", "cpu", "--dry-run"])
    asked = dataclasses.replace(spec, nodes=3)
    said = describe_request(asked, spec.node_range)
    assert said.startswith("at least 2 node(s) of --nodes 2:3 x 1 ranks, each node one group"), said
    fixed = spec_from_args(["--nodes", "2", "--device", "cpu", "--dry-run"])
    said = describe_request(fixed, fixed.node_range)
    assert said.startswith("2 node(s) x 1 ranks"), said


def test_gpu_ranks_past_this_machines_gpus_are_refused_before_a_local_ray_starts():
    from launcher.core.topology import local_gpus_problem

    assert local_gpus_problem(8, 8) is None and local_gpus_problem(1, 2) is None
    assert local_gpus_problem(1, 0).startswith("1 GPU rank(s) asked, and this machine has no GPU for a local")
    assert "has only 4 GPU(s)" in local_gpus_problem(8, 4) and "--device cpu" in local_gpus_problem(8, 4)
