"""Hold back what is written to the process's stderr (file descriptor 2) while a call runs: Ray's C++
client logs its retries there (`rpc_client.h: Failed to connect to GCS ... within 5 seconds`), which
a failed attach would print above megaray's one line that says what is wrong and what to do."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import threading


class HeldStderr:
    """Descriptor 2 points at a temporary file until `release()`, which points it back and writes
    what was held there, or drops it (`drop=True`: the caller says in one line what went wrong).
    Released once, from whichever thread comes first."""

    def __init__(self):
        self._lock = threading.Lock()
        self._saved: int | None = None
        self._held = None

    def hold(self) -> None:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        try:
            held = tempfile.TemporaryFile()  # noqa: SIM115 (closed by release(), from another thread maybe)
            saved = os.dup(2)
            os.dup2(held.fileno(), 2)
        except OSError:  # no descriptor 2 (a daemon), or no room for the file: nothing is held
            return
        self._saved, self._held = saved, held

    def release(self, drop: bool = False) -> None:
        with self._lock:
            if self._saved is None:
                return
            saved, held, self._saved, self._held = self._saved, self._held, None, None
        with contextlib.suppress(Exception):
            sys.stderr.flush()  # Python's own writes while held go to the file too
        os.dup2(saved, 2)
        os.close(saved)
        with held:
            if not drop:
                held.seek(0)
                if text := held.read():
                    os.write(2, text)
