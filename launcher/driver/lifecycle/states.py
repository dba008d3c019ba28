"""The states of a launch (driver/lifecycle/controller.py steps through them), each a frozen object
that carries what it needs, as Ray Train v2's `RestartingState` carries its failure. Apart from the
controller so that an attempt, made from its `Placing`, need not import the controller."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ...core.errors import RankFailedError
from ...core.lifecycle import LaunchState, Restart


@dataclass(frozen=True)
class Placing:
    """Attempt `number` made and placed: on `spares` (the failed attempt's, handed over) when there
    are some; `growing`: the relaunch of a grow, on the nodes that appeared; `avoid`: the nodes found
    lost so far, left out of its placing; `evicted`: the slow nodes dropped (--evict-stragglers),
    left out for good (a lost node that answers again is placed on again, not these)."""

    number: int
    spares: Any = None
    growing: bool = False
    avoid: frozenset[str] = frozenset()
    evicted: frozenset[str] = frozenset()
    kind: ClassVar[LaunchState] = LaunchState.PLACING


@dataclass(frozen=True)
class Starting:
    kind: ClassVar[LaunchState] = LaunchState.STARTING


@dataclass(frozen=True)
class Running:
    kind: ClassVar[LaunchState] = LaunchState.RUNNING


@dataclass(frozen=True)
class Finishing:
    kind: ClassVar[LaunchState] = LaunchState.FINISHING


@dataclass(frozen=True)
class Restarting:
    """The attempt torn down; the next one, `restart.attempt`, is placed with what it takes."""

    restart: Restart
    spares: Any = None
    growing: bool = False
    avoid: frozenset[str] = frozenset()
    kind: ClassVar[LaunchState] = LaunchState.RESTARTING


@dataclass(frozen=True)
class Succeeded:
    result: Any
    kind: ClassVar[LaunchState] = LaunchState.SUCCEEDED


@dataclass(frozen=True)
class Failed:
    """A rank failed with no restart left: `failure` is what the launch raises."""

    failure: RankFailedError
    kind: ClassVar[LaunchState] = LaunchState.FAILED


@dataclass(frozen=True)
class Ended:
    """Interrupted or an error: `kind` from what was raised (core/outcome.run_outcome)."""

    kind: LaunchState


Step = Placing | Starting | Running | Finishing | Restarting | Succeeded | Failed | Ended
