"""The rendezvous store, served from rank 0's process from before any rank's program runs, as
torchrun's agent serves it: every rank (rank 0 too) finds TORCHELASTIC_USE_AGENT_STORE=True and
joins MASTER_ADDR:MASTER_PORT as a client.

Without it, rank 0's program starts the store inside its init_process_group, and a rank that gets
there first finds the port closed: torch's TCPStore client then backs off and joins 0.2-1.3 s after
the store is up (measured on a 2-core machine; more on a cluster where rank 0 imports slower). Here
the port listens from the moment the rank gets its env (a plain socket), so a connection waits in
the listen backlog and is never refused. Serving needs torch, which is not imported ahead of the
program (a script may set OMP_NUM_THREADS or TORCH_LOGS before its own `import torch`): a thread
waits until the program has imported torch, then serves the socket it holds
(`TCPStore(master_listen_fd=...)`), importing nothing itself.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from datetime import timedelta

C10D = "torch._C._distributed_c10d"  # in sys.modules once the program has imported torch
STORE_TIMEOUT = timedelta(minutes=30)  # torch's default for the store's own calls
BACKLOG = 4096  # ranks that connect before the server runs wait here (the kernel caps it at somaxconn)
FAST_POLL_S, SLOW_POLL_S, FAST_FOR_S = 0.005, 0.5, 120.0


class PortTaken(Exception):
    pass


def listen(port: int) -> socket.socket:
    """A listening socket on `port` of every interface (IPv6 and IPv4 where the host has both)."""
    try:
        if socket.has_dualstack_ipv6():
            return socket.create_server(
                ("", port), family=socket.AF_INET6, dualstack_ipv6=True, backlog=BACKLOG
            )
        return socket.create_server(("", port), backlog=BACKLOG)
    except OSError as e:
        raise PortTaken(f"{e.strerror or e}") from None


class StoreHost:
    """Holds MASTER_PORT from now on and serves the store there once torch is imported."""

    def __init__(self, addr: str, port: int):
        self.addr, self.port = addr, port
        self.sock = listen(port)
        self.store = None  # the TCPStore once served: it lives as long as this process
        threading.Thread(target=self._serve_when_imported, name="megaray-store", daemon=True).start()

    def _serve_when_imported(self) -> None:
        start = time.monotonic()
        while (cls := getattr(sys.modules.get(C10D), "TCPStore", None)) is None:
            time.sleep(FAST_POLL_S if time.monotonic() - start < FAST_FOR_S else SLOW_POLL_S)
        try:
            self.store = cls(
                host_name=self.addr,
                port=self.port,
                world_size=None,
                is_master=True,
                timeout=STORE_TIMEOUT,
                wait_for_workers=False,
                multi_tenant=True,  # the program's own master store on this port shares the server
                master_listen_fd=self.sock.fileno(),
            )
            self.sock.detach()  # the server owns the descriptor now
        except Exception as e:  # the ranks' clients are then refused and fail as they would anyway
            self.sock.close()
            print(
                f"megaray: rank 0 could not serve the rendezvous store on port {self.port}: "
                f"{type(e).__name__}: {e}",
                file=sys.stderr,
                flush=True,
            )


def serve_store(addr: str, port: int) -> StoreHost:
    """Rank 0's store on MASTER_PORT, or one line saying the port was taken since it was found free."""
    from ..core.errors import ClusterError

    try:
        return StoreHost(addr, port)
    except PortTaken as e:
        raise ClusterError(
            f"MASTER_PORT {port} on {addr} was taken by another process after megaray found it "
            f"free ({e}): launch again, or choose a port with --master-port"
        ) from None
