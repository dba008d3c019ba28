"""`--nodes MIN:MAX` (core/elastic.py): parsing and the choice of how many nodes an attempt runs on,
without processes."""

from __future__ import annotations

import logging
import re

import pytest

from launcher.core.elastic import (
    Evict,
    EvictPolicy,
    GrowPolicy,
    NodeChoice,
    NodeRange,
    ScalingPolicy,
    choose_nodes,
    parse_nodes,
)
from launcher.core.errors import UsageError
from launcher.core.launch_args import spec_from_args
from launcher.core.placing import PlaceGoal
from launcher.driver.supervision.evict import EvictWatch
from launcher.driver.supervision.stragglers import StragglerWatch


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


def test_a_slow_node_is_dropped_at_the_first_checkpoint_once_due_if_the_job_goes_on_without_it():
    """`--evict-stragglers 30`: a node whose rank has been named slow since t=100 is due at 130 and
    dropped at the first checkpoint saved after that (a Megatron target), at once for a plain program
    that gave --grow-after; never below MIN without room for another node, nor without the flag."""
    at_checkpoint = ScalingPolicy(NodeRange(2, 3), grow=GrowPolicy(at_checkpoint=True), evict=EvictPolicy(30))
    slow = {"n2": 100.0}
    assert at_checkpoint.evict_now(3, 0, slow, checkpoint_at=120.0, now=129.0) is None  # not due yet
    assert at_checkpoint.evict_now(3, 0, slow, checkpoint_at=120.0, now=140.0) is None  # saved before due
    evict = at_checkpoint.evict_now(3, 0, slow, checkpoint_at=135.0, now=140.0)
    assert evict == Evict("n2", 40.0, "a checkpoint was saved since")
    # the slowest-standing node first
    assert at_checkpoint.evict_now(3, 0, {"n1": 105.0, "n2": 95.0}, 135.0, 140.0).node_id == "n2"
    # at MIN (2 of 2:3): only with room for another node, which the relaunch takes in its place
    assert at_checkpoint.evict_now(2, 0, slow, 135.0, 140.0) is None
    assert at_checkpoint.without_slow_node(2, 0) == (
        "running on 2 of --nodes 2:3, its minimum, with no room for another node"
    )
    assert at_checkpoint.evict_now(2, 1, slow, 135.0, 140.0) is not None
    odd = ScalingPolicy(NodeRange(1, 3), odd_worlds, GrowPolicy(at_checkpoint=True), EvictPolicy(30))
    assert odd.without_slow_node(2, 0) == "1 node(s) would not suit the target: TP 2 does not divide 1 ranks"
    consent = ScalingPolicy(NodeRange(2, 3), grow=GrowPolicy(grow_after_s=60), evict=EvictPolicy(30))
    assert consent.evict_now(3, 0, slow, None, 130.0) == Evict("n2", 30.0, "the program resumes itself")
    assert (
        ScalingPolicy(NodeRange(2, 3), grow=GrowPolicy(at_checkpoint=True)).evict_now(3, 0, slow, 135.0, 1e6)
        is None
    )
    for flags, said in (
        (["--evict-stragglers", "0"], "--evict-stragglers must be above 0 seconds, got 0.0"),
        (["--nodes", "2", "--evict-stragglers", "30"],
         "--evict-stragglers drops a node of a job of --nodes MIN:MAX: give a range, or drop it"),
    ):  # fmt: skip
        with pytest.raises(UsageError, match=re.escape(said)):
            spec_from_args(["--nodes", "2:3", *flags, "--dry-run"], environ={})
    given = ["--nodes", "2:3", "--evict-stragglers", "30", "--grow-after", "9", "--dry-run"]
    spec = spec_from_args(given, environ={})
    assert spec.evict_after_s == 30 and spec.at_nodes(2).grow_after_s == 9  # an attempt at MIN (it raised)


def test_a_slow_rank_not_dropped_is_told_once_what_it_costs_and_what_would_fix_it(tmp_path, caplog):
    """The evict watch: ranks named slow (the straggler watch's `slow`) grouped by node; with no flag,
    after a minute, one line per rank: the training it has cost so far and the flag that would drop it."""
    stragglers = StragglerWatch(tmp_path, ["10.0.0.1 (a)", "10.0.0.2 (b)"])
    now = [1000.0]
    fixed = ScalingPolicy(NodeRange(2, 2), grow=GrowPolicy(at_checkpoint=True))
    watch = EvictWatch(
        fixed, stragglers, ["n1", "n2"], {"n1": "10.0.0.1 (a)", "n2": "10.0.0.2 (b)"}, lambda: now[0]
    )
    stragglers.slow[1] = (1000.0, 4.0)
    caplog.set_level(logging.WARNING, logger="megaray")
    assert watch.check(2, 0, None) is None and not caplog.records
    now[0] = 1060.0
    assert watch.check(2, 0, None) is None and watch.check(2, 0, None) is None
    (said,) = [r.getMessage() for r in caplog.records]
    assert said == (
        "rank 1 on 10.0.0.2 (b) has been slow for 1m00s (about 4.0x its peers): it has cost the job "
        "about 45s of training so far; --nodes MIN:MAX with --evict-stragglers S would drop its node at "
        "its next checkpoint and relaunch without it"
    )
    elastic = ScalingPolicy(NodeRange(2, 3), grow=GrowPolicy(at_checkpoint=True), evict=EvictPolicy(30))
    watch = EvictWatch(elastic, stragglers, ["n1", "n2"], {"n2": "10.0.0.2 (b)"}, lambda: now[0])
    caplog.clear()
    assert watch.check(3, 0, 1020.0) is None  # saved before it was due (at 1030): the next one
    assert [r.getMessage().split("; ")[1] for r in caplog.records] == [
        "its node is dropped at the target's next checkpoint"
    ]
    evict = watch.check(3, 0, 1050.0)
    assert evict is not None and str(evict) == (
        "a rank on node 10.0.0.2 (b) has been slow for 60s and a checkpoint was saved since: "
        "dropping its node"
    )


def test_a_relaunch_goes_on_once_every_node_that_could_hold_a_group_holds_one():
    """`--nodes 2:3` on 3 nodes, one lost (or dropped as slow): a relaunch asks for 3, 2 could be
    placed, and it goes on with 2 once they are, not after the settle time; a first launch waits for
    the third until its settle time (a node started by hand may join)."""
    relaunch = PlaceGoal.of(asked=3, at_least=2, fit=2, settle=105.0, deadline=160.0, again=True)
    assert relaunch.met(2, now=100.0) and not relaunch.met(1, now=104.0)
    assert not relaunch.met(1, now=160.0)  # fewer than MIN is never enough: the deadline fails it
    first = PlaceGoal.of(asked=3, at_least=2, fit=2, settle=160.0, deadline=160.0, again=False)
    assert not first.met(2, now=100.0) and first.met(2, now=160.0) and first.met(3, now=100.0)
    # a node more than the groups asked could hold one: the goal is what was asked
    assert PlaceGoal.of(asked=2, at_least=2, fit=5, settle=1.0, deadline=2.0, again=True).at_once == 2
