"""megaray's own probes of the job's nodes (the rule is core/liveness.py): from the driver, a TCP
connection to each node's raylet about once a second, started and read without blocking from the
supervision loop, so a thousand nodes cost a thousand sockets a second and no thread."""

from __future__ import annotations

import errno
import logging
import os
import selectors
import socket
import time
from collections.abc import Callable

from ...core.liveness import PROBE_TIMEOUT_S, Liveness, probe_every
from ..cluster.fds import fd_budget

log = logging.getLogger("megaray")


def raylet_addresses(node_ids: set[str]) -> dict[str, tuple[str, int]]:
    """node id -> its raylet's (ip, port), from one read of Ray's node table."""
    import ray

    return {
        n["NodeID"]: (n["NodeManagerAddress"], n["NodeManagerPort"])
        for n in ray.nodes()
        if n["NodeID"] in node_ids
    }


class NodeProbes:
    def __init__(self, addresses: dict[str, tuple[str, int]], clock: Callable[[], float] = time.monotonic):
        """`addresses`: node id -> its raylet's (ip, port)."""
        self.addresses, self.clock = addresses, clock
        now = clock()
        self.liveness = Liveness(list(addresses), now)
        # spread over a period, not all at once: a thousand sockets opened in one turn would pass the
        # usual limit of 1,024 descriptors, and the answers would all come in one turn too
        n = max(1, len(addresses))
        self.every = probe_every(n)
        self.next_at = {node: now + self.every * i / n for i, node in enumerate(addresses)}
        self.max_inflight = fd_budget(len(addresses))
        self.inflight: dict[str, tuple[socket.socket, float]] = {}
        self.selector = selectors.DefaultSelector()
        self.told: set[str] = set()  # the unprobed nodes said so

    def tick(self) -> dict[str, tuple[float, str]]:
        """Start the probes due, read those answered or timed out; the nodes lost so far."""
        now = self.clock()
        for node, (ip, port) in self.addresses.items():
            if (
                node not in self.inflight
                and now >= self.next_at[node]
                and len(self.inflight) < self.max_inflight
            ):
                self._start(node, ip, port, now)
        for key, _ in self.selector.select(timeout=0):
            node = key.data
            sock, started = self._end(node)
            err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            sock.close()
            if err == 0:
                self.liveness.answered(node, now)
            else:
                self.liveness.missed(node, os.strerror(err))
        for node, (_, started) in list(self.inflight.items()):
            if now - started >= PROBE_TIMEOUT_S:
                self._end(node)[0].close()
                self.liveness.missed(node, f"no answer within {PROBE_TIMEOUT_S:g}s")
        for node, why in self.liveness.unprobed().items():
            if node not in self.told:
                self.told.add(node)
                ip, port = self.addresses[node]
                log.warning(
                    "node %s (node id %s): its raylet's port %d never answered this driver (%s): a lost node "
                    "there is left to Ray's health checks (about a minute with their defaults)",
                    ip, node[:8], port, why,
                )  # fmt: skip
        return self.liveness.lost(now)

    def _start(self, node: str, ip: str, port: int, now: float) -> None:
        self.next_at[node] = now + self.every
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError as e:  # out of descriptors: this driver's trouble, not the node's; next turn
            log.debug("no socket to probe node %s: %s", node[:8], e)
            return
        sock.setblocking(False)
        err = sock.connect_ex((ip, port))
        if err in (0, errno.EINPROGRESS):
            self.inflight[node] = (sock, now)
            self.selector.register(sock, selectors.EVENT_WRITE, node)
            return
        sock.close()
        self.liveness.missed(node, os.strerror(err))

    def _end(self, node: str) -> tuple[socket.socket, float]:
        sock, started = self.inflight.pop(node)
        self.selector.unregister(sock)
        return sock, started

    def close(self) -> None:
        for node in list(self.inflight):
            self._end(node)[0].close()
        self.selector.close()
