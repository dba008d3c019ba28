"""What one node sends the driver's output sink at a time (rank/forwarder.py -> driver/output/relay.py).

Ranks send their output to a forwarder on their own node, which sends one batch at a time to the
sink: the sink's calls grow with the nodes, not the ranks, and a sink slower than the output makes
the node wait (its ranks' bytes stay in their spools on disk), never grows anyone's memory. What a
batch takes from what the forwarder holds is decided here, without Ray, and tested so.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .straggler import Sample

STDOUT, STDERR = 1, 2  # a rank's streams, by their file descriptors


class Source(NamedTuple):
    """One of a rank's two output streams: each is spooled apart (rank/capture.py), so that the
    console puts a rank's stderr on the launcher's stderr, as torchrun does, and its stdout on stdout."""

    rank: int
    stream: int = STDOUT


FIRST = Source(0)

MIN_BATCH_BYTES = 64 << 10
MAX_BATCH_BYTES = 4 << 20
ALL_BATCHES_BYTES = 64 << 20  # every node's batch in flight together, at most (one each)
CALLS_PER_S = 1000  # batches a second the sink gets from all the nodes together, at most
MIN_EVERY_S = 0.05  # how long a burst is gathered into one batch on a small job


@dataclass(frozen=True)
class OutputBatch:
    """Rank output by offset in each of a rank's spools, progress reports, and straggler samples
    (core/straggler.py);
    `writes` counts the ranks' own writes in it: the activity hang detection watches."""

    chunks: tuple[tuple[Source, int, bytes], ...] = ()  # (source, start, data)
    reports: tuple[tuple[int, dict[str, Any]], ...] = ()
    samples: tuple[Sample, ...] = ()
    writes: int = 0

    def __bool__(self) -> bool:
        return bool(self.chunks or self.reports or self.samples)


def batch_bytes(nodes: int) -> int:
    """A node's share of what may be in flight to the sink at once."""
    return min(MAX_BATCH_BYTES, max(MIN_BATCH_BYTES, ALL_BATCHES_BYTES // max(1, nodes)))


def send_every(nodes: int) -> float:
    """Seconds a node gathers before it sends: the sink gets at most CALLS_PER_S calls a second."""
    return max(MIN_EVERY_S, nodes / CALLS_PER_S)


@dataclass
class Held:
    """What a node's forwarder holds for the sink, by rank's stream, in the order it came."""

    console: frozenset[int] = frozenset()  # ranks
    chunks: dict[Source, list[tuple[int, bytes]]] = field(default_factory=dict)
    reports: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    bytes: int = 0
    writes: int = 0
    turn: Source = FIRST  # where the last batch's ranks left off, so that each rank gets its turn

    def add(self, source: Source, data: bytes, start: int) -> None:
        self.chunks.setdefault(source, []).append((start, data))
        self.bytes += len(data)
        self.writes += 1

    def for_console(self) -> bool:
        """Whether a console rank's lines or a progress report wait: the console shows them."""
        return bool(self.reports) or any(s.rank in self.console for s in self.chunks)

    def take(self, budget: int) -> OutputBatch:
        """Every report and wait sample, the console ranks' output, then the other ranks' in turns
        until `budget` bytes of theirs (at least one chunk): what is left goes in the next batch."""
        others = sorted(s for s in self.chunks if s.rank not in self.console)
        k = next((i for i, s in enumerate(others) if s >= self.turn), 0)
        order = [*sorted(s for s in self.chunks if s.rank in self.console), *others[k:], *others[:k]]
        taken: list[tuple[Source, int, bytes]] = []
        size = others_size = 0
        for source in order:
            queue = self.chunks[source]
            console = source.rank in self.console
            while queue and (console or others_size < budget or not taken):
                start, data = queue.pop(0)
                taken.append((source, start, data))
                size += len(data)
                others_size += 0 if console else len(data)
            if not queue:
                del self.chunks[source]
            elif not console:
                self.turn = source
                break
        else:
            self.turn = FIRST
        batch = OutputBatch(tuple(taken), tuple(self.reports), tuple(self.samples), self.writes)
        self.bytes -= size
        self.reports, self.samples, self.writes = [], [], 0
        return batch

    def __bool__(self) -> bool:
        return bool(self.chunks or self.reports or self.samples)


def merged(chunks: Iterable[tuple[Source, int, bytes]]) -> list[tuple[Source, int, bytes]]:
    """Adjacent chunks of one rank's stream joined (one write to its file instead of many)."""
    out: list[tuple[Source, int, bytes]] = []
    for source, start, data in chunks:
        if out and out[-1][0] == source and out[-1][1] + len(out[-1][2]) == start:
            out[-1] = (source, out[-1][1], out[-1][2] + data)
        else:
            out.append((source, start, data))
    return out
