"""`--nodes MIN:MAX` (core/elastic.py): parsing and the choice of how many nodes an attempt runs on,
without processes."""

from __future__ import annotations

import pytest

from launcher.core.elastic import NodeChoice, NodeRange, choose_nodes, parse_nodes
from launcher.core.errors import UsageError
from launcher.core.spec import spec_from_args


def test_nodes_are_n_or_min_max_as_torchrun_spells_them():
    assert parse_nodes("4") == NodeRange(4, 4) and not parse_nodes("4").elastic
    assert parse_nodes("2:3") == NodeRange(2, 3) and parse_nodes("2:3").elastic
    spec = spec_from_args(["--nodes", "2:3", "--dry-run"], environ={})
    assert (spec.nodes, spec.min_nodes, str(spec.node_range)) == (3, 2, "2:3")
    assert spec_from_args(["--nodes", "3", "--dry-run"], environ={}).node_range == NodeRange(3, 3)


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ("3:2", "--nodes 3:2: the minimum (3) is above the maximum (2)"),
        ("0", "--nodes must be at least 1, got 0"),
        ("0:2", "--nodes must be at least 1, got 0"),
        ("two", "--nodes takes N or MIN:MAX (as torchrun's --nnodes), got 'two'"),
        ("2:", "--nodes takes N or MIN:MAX (as torchrun's --nnodes), got '2:'"),
    ],
)
def test_a_bad_node_count_is_one_line_with_the_numbers(given, said):
    with pytest.raises(UsageError) as e:
        spec_from_args(["--nodes", given, "--dry-run"], environ={})
    assert str(e.value) == said


def odd_worlds(n: int) -> str | None:
    """A stand-in target: TP 2 x PP 1 on 1 rank a node cannot take an odd node count."""
    return None if n % 2 == 0 else f"TP 2 does not divide {n} ranks"


def test_the_most_nodes_the_cluster_holds_within_the_range():
    assert choose_nodes(5, NodeRange(2, 3), lambda n: None) == NodeChoice(3, 5)
    assert choose_nodes(2, NodeRange(2, 3), lambda n: None) == NodeChoice(2, 2)
    assert choose_nodes(1, NodeRange(2, 3), lambda n: None) == NodeChoice(None, 1)


def test_a_count_the_target_cannot_take_is_passed_over_with_its_reason():
    choice = choose_nodes(5, NodeRange(2, 5), odd_worlds)
    assert choice == NodeChoice(4, 5, ((5, "TP 2 does not divide 5 ranks"),))
    assert choice.describe(NodeRange(2, 5)) == "4 of 5 node(s); not 5: TP 2 does not divide 5 ranks"
    fewer = choose_nodes(3, NodeRange(2, 4), odd_worlds)
    assert fewer.describe(NodeRange(2, 4)) == (
        "2 of 4 node(s): the cluster holds 3; not 3: TP 2 does not divide 3 ranks"
    )
    none = choose_nodes(3, NodeRange(3, 3), odd_worlds)
    assert none.nodes is None
    assert none.describe(NodeRange(3, 3)) == (
        "no node count from 3 to 3 suits the target; not 3: TP 2 does not divide 3 ranks"
    )
    most = choose_nodes(4, NodeRange(2, 4), odd_worlds)
    assert most.describe(NodeRange(2, 4)) == "4 node(s), the most asked for"


def test_the_dry_run_keeps_one_layout_and_global_batch_and_names_the_counts_it_cannot_take():
    from launcher.megatron.runners import DryRunRunner

    runner = DryRunRunner()
    spec = spec_from_args(["--nodes", "2:4", "--gpus-per-node", "2", "--dry-run", "steps=9"], environ={})
    target = runner.first_target(spec, None)
    assert target.args == ("steps=9", "tp=2", "pp=1", "global_batch=32")  # TP 2 x DP 4 on 4 nodes
    assert runner.size_problem(spec, None, 4) is None and runner.size_problem(spec, None, 2) is None
    assert runner.size_problem(spec, None, 3) == "global batch 32 is not a multiple of micro batch 4 x DP 3"
    given = spec_from_args(
        ["--nodes", "2:4", "--gpus-per-node", "2", "--dry-run", "tp=2", "pp=2", "global_batch=48"], environ={}
    )
    assert runner.first_target(given, None).args == ("tp=2", "pp=2", "global_batch=48")
    assert runner.size_problem(given, None, 3) == "TP 2 x PP 2 = 4 does not divide 6 ranks"
    fixed = spec_from_args(["--nodes", "4", "--gpus-per-node", "2", "--dry-run"], environ={})
    assert runner.first_target(fixed, None) == fixed.target  # not elastic: the trainer picks its own


def test_an_attempt_on_fewer_nodes_keeps_the_console_ranks_it_has():
    argv = ["--nodes", "2:4", "--gpus-per-node", "2", "--log-ranks", "1,6", "--dry-run"]
    spec = spec_from_args(argv, environ={})
    two = spec.at_nodes(2)
    assert (two.nodes, two.world_size, two.console_ranks, str(two.node_range)) == (2, 4, {1}, "2")
    assert spec.at_nodes(2).at_nodes(2) == two
    none_left = spec_from_args(["--nodes", "1:4", "--log-ranks", "3", "--dry-run"], environ={}).at_nodes(1)
    assert none_left.console_ranks == {0}


def test_an_attempt_grows_at_the_first_checkpoint_after_room_appeared_or_after_grow_after():
    from launcher.core.elastic import GrowPolicy

    megatron = GrowPolicy(at_checkpoint=True)
    assert not megatron.grow_now(None, 50.0, 100.0)  # no room: never
    assert not megatron.grow_now(60.0, 50.0, 100.0)  # the last checkpoint is older than the room
    assert megatron.grow_now(60.0, 61.0, 100.0)
    plain = GrowPolicy(grow_after_s=30)
    assert not plain.grow_now(60.0, None, 89.0) and plain.grow_now(60.0, None, 90.0)
    assert not GrowPolicy().grow_now(0.0, 1.0, 1e9)  # a plain program without --grow-after: at a failure
    assert GrowPolicy(True, 30).describe() == "at its next checkpoint or 30s after"


def test_the_scaling_policy_sizes_a_new_attempt_takes_the_spares_left_and_decides_a_grow():
    """One policy for the node counts (Ray Train v2's ScalingPolicy): placing, the spares a lost node
    left, and a running attempt below MAX with room for more."""
    from launcher.core.elastic import GrowPolicy, GrowTo, ScalingPolicy

    odd = ScalingPolicy(
        NodeRange(1, 4), lambda n: "an odd DP" if n % 2 else None, GrowPolicy(grow_after_s=30)
    )
    assert odd.size(3) == NodeChoice(2, 3, ((3, "an odd DP"),))  # as choose_nodes
    assert odd.takes(2) and not odd.takes(3) and not odd.takes(5)
    assert not ScalingPolicy(NodeRange(2, 2)).takes(2)  # a fixed count: the spares are placed anew
    assert odd.can_grow(2) and not odd.can_grow(4) and not ScalingPolicy(NodeRange(2, 2)).can_grow(1)
    assert odd.grow_to(2, 4) == 4 and odd.grow_to(2, 3) is None and odd.grow_to(4, 4) is None
    assert odd.grow_now(2, 4, None, None, 100.0) is None  # no room
    assert odd.grow_now(2, 4, 60.0, None, 89.0) is None  # not yet: --grow-after 30
    assert odd.grow_now(2, 4, 60.0, None, 90.0) == GrowTo(
        4, "the cluster has room for 4 node(s) of --nodes 1:4 (running on 2), for 30s"
    )
    at_checkpoint = ScalingPolicy(NodeRange(1, 4), grow=GrowPolicy(at_checkpoint=True))
    assert at_checkpoint.grow_now(2, 4, 60.0, 61.0, 62.0).why.endswith("a checkpoint was saved since")
    assert at_checkpoint.grow_now(2, 2, 60.0, 61.0, 62.0) is None  # no more nodes than it runs on
