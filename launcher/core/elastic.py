"""An elastic node count (`--nodes MIN:MAX`, as torchrun's `--nnodes` spells it): how many nodes an
attempt runs on, decided without processes.

A launch asks for MAX nodes and runs on as many as the cluster holds, at least MIN. Not every count
in between suits every target: a Megatron layout needs TP x PP x CP to divide the world and the
global batch to divide by the data-parallel size times the micro-batch. The target says what is
wrong with a count (`TargetRunner.size_problem`); `choose_nodes` takes the largest count with nothing
wrong and says why it passed over the larger ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class NodeRange:
    """`--nodes N` (N:N) or `--nodes MIN:MAX`."""

    min: int
    max: int

    def __post_init__(self):
        if self.min < 1:
            raise ValueError(f"--nodes must be at least 1, got {self.min}")
        if self.max < self.min:
            raise ValueError(
                f"--nodes {self.min}:{self.max}: the minimum ({self.min}) is above the maximum ({self.max})"
            )

    @property
    def elastic(self) -> bool:
        return self.min < self.max

    def __str__(self) -> str:
        return f"{self.min}:{self.max}" if self.elastic else str(self.max)


def parse_nodes(text: str) -> NodeRange:
    """`4` or `2:4`; a ValueError names what was given and what is taken."""
    lo, sep, hi = text.strip().partition(":")
    try:
        low = int(lo)
        high = int(hi) if sep else low
    except ValueError:
        raise ValueError(f"--nodes takes N or MIN:MAX (as torchrun's --nnodes), got {text!r}") from None
    return NodeRange(low, high)


@dataclass(frozen=True)
class NodeChoice:
    """How many nodes an attempt runs on (None: no count from MIN up fits), and the larger counts
    passed over: (nodes, why)."""

    nodes: int | None
    fit: int  # how many nodes the cluster held
    skipped: tuple[tuple[int, str], ...] = ()

    def describe(self, wanted: NodeRange) -> str:
        """One line for the console and topology.json."""
        if self.nodes is None:
            head = f"no node count from {wanted.min} to {min(self.fit, wanted.max)} suits the target"
        elif self.nodes == wanted.max:
            return f"{self.nodes} node(s), the most asked for"
        elif self.fit < wanted.max:
            head = f"{self.nodes} of {wanted.max} node(s): the cluster holds {self.fit}"
        else:
            head = f"{self.nodes} of {wanted.max} node(s)"
        passed = "; ".join(f"not {n}: {why}" for n, why in self.skipped)
        return f"{head}; {passed}" if passed else head


def choose_nodes(fit: int, wanted: NodeRange, problem: Callable[[int], str | None]) -> NodeChoice:
    """The largest count of nodes up to `fit` (what the cluster holds) within `wanted` that the target
    can run on (`problem(n)` is None)."""
    skipped = []
    for n in range(min(fit, wanted.max), wanted.min - 1, -1):
        why = problem(n)
        if why is None:
            return NodeChoice(n, fit, tuple(skipped))
        skipped.append((n, why))
    return NodeChoice(None, fit, tuple(skipped))


@dataclass(frozen=True)
class GrowPolicy:
    """When an attempt running below MAX nodes is ended to relaunch on more, once the cluster has room
    for another node (`room_since`): at the next checkpoint the target writes after that (the Megatron
    targets: no step older than that checkpoint is lost), or `grow_after_s` after it (`--grow-after`,
    as Ray Train's resize check, for a plain program that resumes itself); else only at its next
    failure, which relaunches on as many nodes as then hold a group."""

    at_checkpoint: bool = False
    grow_after_s: float | None = None

    def grow_now(self, room_since: float | None, last_checkpoint_at: float | None, now: float) -> bool:
        if room_since is None:
            return False
        if self.at_checkpoint and last_checkpoint_at is not None and last_checkpoint_at >= room_since:
            return True
        return self.grow_after_s is not None and now - room_since >= self.grow_after_s

    def describe(self) -> str:
        how = []
        if self.at_checkpoint:
            how.append("at its next checkpoint")
        if self.grow_after_s is not None:
            how.append(f"{self.grow_after_s:g}s after")
        return " or ".join(how) or "at its next failure"


@dataclass(frozen=True)
class GrowTo:
    """End this attempt and relaunch on up to `nodes` nodes: what a look at a running attempt below
    MAX nodes finds once the cluster has room (core/poll.py)."""

    nodes: int
    why: str


@dataclass(frozen=True)
class Evict:
    """End this attempt and relaunch without the node `node_id`, kept off for the rest of the launch
    (`--evict-stragglers`): its ranks stayed named slow (driver/supervision/stragglers.py)."""

    node_id: str
    slow_s: float  # how long a rank of it had been named slow
    when: str  # why now: "a checkpoint was saved since", "the program resumes itself"
    name: str = ""  # how the console names the node (its IP and host name)

    def __str__(self) -> str:
        node = self.name or self.node_id[:8]
        return (
            f"a rank on node {node} has been slow for {self.slow_s:.0f}s and {self.when}: dropping its node"
        )


@dataclass(frozen=True)
class EvictPolicy:
    """When a node whose rank is named slow is dropped (`--evict-stragglers AFTER_S`, `after_s`; None:
    never): once the rank has been slow for `after_s`, at the next checkpoint the target writes after
    that (no step older than it lost), or at once for a plain program that resumes itself (it gave
    `--grow-after`, its consent to be relaunched while it runs)."""

    after_s: float | None = None

    def due(self, slow_since: float, now: float) -> float | None:
        """When the node became due to be dropped, if it has."""
        if self.after_s is None or now - slow_since < self.after_s:
            return None
        return slow_since + self.after_s

    @staticmethod
    def now(grow: GrowPolicy, due_at: float, checkpoint_at: float | None) -> bool:
        if grow.at_checkpoint:
            return checkpoint_at is not None and checkpoint_at >= due_at
        return grow.grow_after_s is not None


def _suits_any(nodes: int) -> str | None:
    return None


@dataclass(frozen=True)
class ScalingPolicy:
    """How many nodes an attempt runs on, and when a running one grows: Ray Train v2's
    `ScalingPolicy`, which decides for a group not yet running and for a running one. From
    `--nodes MIN:MAX` (`asked`), what the target cannot run on (`problem`: its runner's
    `size_problem`) and when a grow is worth a relaunch (`grow`). Every rule here is pure."""

    asked: NodeRange
    problem: Callable[[int], str | None] = _suits_any
    grow: GrowPolicy = GrowPolicy()
    evict: EvictPolicy = EvictPolicy()

    def size(self, fit: int) -> NodeChoice:
        """Placing: the largest count up to `fit` (what the cluster holds) that suits."""
        return choose_nodes(fit, self.asked, self.problem)

    def takes(self, nodes: int) -> bool:
        """Whether an attempt may run on `nodes` (the warm spares of the nodes a loss left)."""
        asked = self.asked
        return asked.elastic and asked.min <= nodes <= asked.max and self.problem(nodes) is None

    def can_grow(self, running: int) -> bool:
        return self.asked.elastic and running < self.asked.max

    def grow_to(self, running: int, fit: int) -> int | None:
        """Running on `running` nodes while `fit` would hold a group: the count to grow to, if larger."""
        nodes = self.size(fit).nodes
        return nodes if nodes is not None and nodes > running else None

    def grow_now(
        self, running: int, target: int, room_since: float | None, checkpoint_at: float | None, now: float
    ) -> GrowTo | None:
        """Running on `running` nodes with room for `target` since `room_since` (None: no room): the
        grow, once the grow policy says it is time (`checkpoint_at`: the target's last checkpoint;
        the same clock as `now`)."""
        if target <= running or not self.grow.grow_now(room_since, checkpoint_at, now):
            return None
        saved = checkpoint_at is not None and checkpoint_at >= room_since
        when = "a checkpoint was saved since" if saved else f"for {now - room_since:.0f}s"
        room = f"the cluster has room for {target} node(s) of --nodes {self.asked} (running on {running})"
        return GrowTo(target, f"{room}, {when}")

    def without_slow_node(self, running: int, room: int) -> str | None:
        """Why an attempt on `running` nodes, with `room` for more on the cluster, cannot drop one: the
        relaunch without it runs on `running - 1`, or on `running` where there is room; None: it can."""
        if not self.asked.elastic:
            return "the job runs on a fixed node count (--nodes N)"
        if self.takes(running - 1) or (room > 0 and self.takes(running)):
            return None
        if running - 1 < self.asked.min:
            return f"running on {running} of --nodes {self.asked}, its minimum, with no room for another node"
        return f"{running - 1} node(s) would not suit the target: {self.problem(running - 1)}"

    def evict_now(
        self, running: int, room: int, slow: dict[str, float], checkpoint_at: float | None, now: float
    ) -> Evict | None:
        """`slow`: since when each node has had a rank named slow (the clock of `now` and
        `checkpoint_at`): the node slow longest, once the evict policy says it is time and the job
        can go on without it."""
        due = [(at, node) for node, since in slow.items() if (at := self.evict.due(since, now)) is not None]
        if not due or self.without_slow_node(running, room) is not None:
            return None
        due_at, node = min(due)
        if not self.evict.now(self.grow, due_at, checkpoint_at):
            return None
        when = "a checkpoint was saved since" if self.grow.at_checkpoint else "the program resumes itself"
        return Evict(node, now - slow[node], when)
