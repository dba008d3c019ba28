"""Can one node reach another on the port a rendezvous uses? Probed with plain TCP where the ranks
run, before the program starts: a rank that cannot reach MASTER_ADDR:MASTER_PORT would otherwise sit
in torch's connect retries, printing a warning every few seconds, until the store's timeout.

The listener accepts and waits for the peer to close first, so that no TIME_WAIT is left on the
port the real rendezvous binds a moment later.
"""

from __future__ import annotations

import contextlib
import errno
import socket
import threading
import time


class Listener:
    """A TCP listener on `port` of every interface, accepting until `close()`."""

    def __init__(self, port: int):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("0.0.0.0", port))
        self.sock.listen(128)
        self.sock.settimeout(0.2)
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self._serve, name="megaray-link-probe", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.closed.is_set():
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            threading.Thread(target=_drain, args=(conn,), daemon=True).start()

    def close(self) -> None:
        self.closed.set()
        self.thread.join(timeout=2)
        self.sock.close()


def _drain(conn: socket.socket) -> None:
    """Wait for the peer to close (it does at once), then close: the TIME_WAIT stays on its side."""
    with conn:
        conn.settimeout(5)
        with contextlib.suppress(OSError):
            conn.recv(1)


def reach(host: str, port: int, timeout_s: float) -> str | None:
    """None when a TCP connection to host:port opens within `timeout_s`, else why not."""
    deadline = time.monotonic() + timeout_s
    last = "timed out"
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic())):
                return None
        except TimeoutError:
            last = f"no answer within {timeout_s:g} s (a firewall, or a route that goes nowhere)"
        except OSError as e:
            # refused: nothing listens on the port from here (a firewall's reject, or the wrong host)
            last = "connection refused" if e.errno == errno.ECONNREFUSED else (e.strerror or str(e))
            time.sleep(0.05)
    return last


class LinkProbe:
    """On one node, for `megaray doctor`: listen on a free port of the rendezvous range, and try the
    other nodes' listeners. An actor, so that its listener lives while the others probe it."""

    def __init__(self, node_ip: str):
        self.node_ip = node_ip
        self.listener: Listener | None = None

    def listen(self, seed: str) -> tuple[int, str | None]:
        """A port of the rendezvous range, listened on; and this node's interface for its Ray IP."""
        from ..core.topology import candidate_ports
        from .probes import ephemeral_range, interface_of, port_is_free

        port = next(p for p in candidate_ports(seed, exclude=ephemeral_range()) if port_is_free(p))
        self.listener = Listener(port)
        return port, interface_of(self.node_ip)

    def reach_all(self, targets: list[tuple[str, int]], timeout_s: float) -> list[str | None]:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=min(16, len(targets) or 1)) as pool:
            return list(pool.map(lambda t: reach(t[0], t[1], timeout_s), targets))

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()
