"""In a rank: its output and progress, sent to the launch's sink (driver/output/relay.py).

Ray's own log streaming prints every rank's lines with a long prefix and keeps them on the node
that produced them. Here each rank's stdout and stderr (the file descriptors, so NCCL's and other C
libraries' output too) go to two spool files on the node (rank/spool.py), one each, so that the
console puts them where torchrun would; a thread sends what arrives there to its node's forwarder
(rank/forwarder.py), which batches the node's ranks for the sink on the driver's node; `report()`
sends progress the same way. No shared filesystem is needed, and what a dying process wrote last
stays in the spools for the driver.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any

from ..core.outbatch import STDERR, STDOUT, Source
from ..core.progress import Phase
from ..core.reports import clean_report
from .spool import err_spool

_current: Capture | None = None
_said: set[str] = set()  # the fields report() said it left out, each said once per process
PUMP_IDLE_S = 0.02  # how often an idle rank's spool is looked at
PUMP_GATHER_S = 0.03  # how long a burst of lines is gathered into one message


def current_sink() -> Any:
    """The sink this rank's output goes to (None outside a megaray launch)."""
    return _current.sink if _current is not None else None


class Capture:
    """In a rank: file descriptors 1 and 2 go to their spools; a thread sends what arrives to `sink`:
    the node's forwarder (or, in a test, the driver's sink itself: both take the same calls)."""

    def __init__(self, sink: Any, rank: int, spool: str):
        global _current
        _current = self
        self.sink, self.rank = sink, rank
        self.last_refs: dict[int, Any] = {}  # each stream's last write
        self.sent = {STDOUT: 0, STDERR: 0}  # bytes of each spool sent to the sink
        self.stopped = False  # the process is exiting: no more Ray calls (`stop_sending`)
        self.returning = False  # the program's call has ended: a stop now has nothing to end
        self.stop_sent = False  # the driver's stop was passed on to this process (its SIGTERM)
        self._turn = threading.Lock()  # which came first: the call's end, or the driver's stop
        self.reports: deque[tuple[int, dict[str, Any]]] = deque()  # report()'s, for the pump to send
        self._sending = threading.Lock()
        sys.stdout.flush()
        sys.stderr.flush()
        self.read_fds = {}
        for fd, path in ((STDOUT, spool), (STDERR, err_spool(spool))):
            write_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_TRUNC, 0o600)
            os.dup2(write_fd, fd)
            os.close(write_fd)
            self.read_fds[fd] = os.open(path, os.O_RDONLY)
        # Python's own streams must not hold lines back: a rank that dies loses what is buffered.
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(AttributeError, ValueError):
                stream.reconfigure(line_buffering=True)
        threading.Thread(target=self._pump, name="megaray-output", daemon=True).start()
        self.control_ref: Any = None
        self.control = threading.Thread(target=self._stop_when_asked, name="megaray-control", daemon=True)
        self.control.start()
        # On a hang the driver asks for this rank's stack where py-spy cannot attach.
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)

    def _stop_when_asked(self) -> None:
        """SIGTERM to this process when the driver stops the ranks (a peer failed, or Ctrl-C): the
        program's own handler runs, if it has one, or the process ends as a plain one would."""
        import ray

        try:
            self.control_ref = self.sink.wait_stop.remote()
            ray.get(self.control_ref)
        except Exception:  # cancelled (the program returned), or the sink is gone with the driver
            return
        with self._turn:
            if self.returning:  # its failure is on its way to the driver, which lists it (#45): not killed
                return
            self.stop_sent = True
        os.kill(os.getpid(), signal.SIGTERM)

    def call_ended(self) -> bool:
        """The program's call has ended (returned, raised or exited): a stop from here on leaves its
        result to come back. Returns whether the driver's stop had reached this process first, whose
        SIGTERM may be what ended it. The rank decides, not the driver by comparing its clock with the
        rank's: the nodes' clocks differ, and a rank's failure a moment after the stop began but before
        its signal came (a loaded machine) is still the program's own (#45)."""
        with self._turn:
            self.returning = True
            return self.stop_sent

    def end_control(self) -> None:
        """The program returned: no stop will come. A thread still waiting in a Ray call would keep
        the process from exiting, so the wait is cancelled and the thread joined."""
        import ray

        deadline = time.monotonic() + 5
        while self.control_ref is None and self.control.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if self.control_ref is not None:
            with contextlib.suppress(Exception):
                ray.cancel(self.control_ref)
        self.control.join(timeout=max(0.0, deadline - time.monotonic()))

    def _pump(self) -> None:
        """Send what the spools get to the sink, one write per stream in flight at a time: a sink
        slower than the ranks (thousands of them, or a flood of output) slows the sending, not the
        program, and what waits stays in the spools on disk, not in memory; the next write carries
        all of it (up to 1 MiB). It waits on Python futures, never inside a Ray call: a thread in
        Ray's C++ wait while the process exits would keep the exit from finishing."""
        sent: list[Future] = []  # the last writes' completions
        while True:
            if sent:
                wait_futures(sent)
            sent = self._send_reports()
            got = {fd: os.read(r, 1 << 20) for fd, r in self.read_fds.items()}
            if not any(got.values()):
                time.sleep(PUMP_IDLE_S)
                continue
            # A moment's wait gathers a burst of lines into one message to the sink.
            time.sleep(PUMP_GATHER_S)
            for fd, data in got.items():
                if data and len(data) < 1 << 20:
                    got[fd] = data + os.read(self.read_fds[fd], (1 << 20) - len(data))
            with self._sending:
                if self.stopped:  # what was read stays in the spool: the exit watch ships it
                    return
                for fd, data in got.items():  # stdout first: a traceback follows what was printed
                    if data:
                        ref = self.sink.write.remote(Source(self.rank, fd), data, self.sent[fd])
                        self.last_refs[fd] = ref
                        sent.append(ref.future())
                        self.sent[fd] += len(data)

    def _send_reports(self) -> list[Future]:
        """What report() gathered since the last turn, in one call: a call each cost the program
        ~0.3 ms a report (#46)."""
        if not self.reports:
            return []
        batch = []
        while self.reports:
            batch.append(self.reports.popleft())
        with self._sending:
            if self.stopped:
                return []
            ref = self.sink.reports.remote(batch)
            self.last_refs[0] = ref  # waited for as the streams' writes are (sync, stop_sending)
            return [ref.future()]

    def stop_sending(self, timeout_s: float = 5.0) -> None:
        """Before the process exits: Ray shuts its worker down before Python's exit handlers run, and
        a Ray call after that ends the process at once, the rest of the handlers unrun (an exit that
        looked like a crash, now and then, on a loaded machine). What they print stays in the spool,
        which the driver's exit watch ships (rank/spool.py exit_and_ship)."""
        with self._sending:
            self.stopped = True
            last = list(self.last_refs.values())
        if last:
            with contextlib.suppress(Exception):
                wait_futures([ref.future() for ref in last], timeout=timeout_s)

    def sync(self, timeout_s: float = 10.0) -> None:
        """Return once everything written so far has reached the driver's sink (before the rank
        reports): sent to the forwarder, and the forwarder flushed."""
        import ray

        flush_streams()
        deadline = time.monotonic() + timeout_s
        # the spools' sizes through our own descriptors: a program may have closed 1 and 2
        while time.monotonic() < deadline and (
            self.reports or any(self.sent[fd] < os.fstat(r).st_size for fd, r in self.read_fds.items())
        ):
            time.sleep(0.01)
        if last := list(self.last_refs.values()):
            ray.wait(last, num_returns=len(last), timeout=max(0.0, deadline - time.monotonic()))
            with contextlib.suppress(Exception):
                ray.wait([self.sink.flush.remote()], timeout=max(0.0, deadline - time.monotonic()))


def flush_streams() -> None:
    """What Python holds of the program's output, written; nothing when the program closed its
    stdout or stderr (file descriptors 1 and 2), as a Python process at exit ignores that too."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stream.flush()


def report(
    iteration: int, total: int | None = None, loss: float | None = None, tokens: int | None = None,
    lr: float | None = None, flops: float | None = None,
) -> None:  # fmt: skip
    """Tell the driver how training goes, from a rank (one rank for the console; every rank for a
    step time per rank in the metrics, core/metrics.py).

    `tokens` and `flops` are what one iteration processes across all ranks (global batch x sequence
    length; the model's FLOPs for it, as Lightning's `flops_per_batch`: with them, TFLOP/s and MFU);
    `lr` is the learning rate. Outside a megaray launch this does nothing, so programs can call it
    unconditionally.
    """
    sink = current_sink()
    if sink is None or _current.stopped:
        return  # not a megaray rank (torchrun, or a plain process), or one exiting
    # never fails the program, which under torchrun calls a no-op: values that are not numbers are
    # left out (core/reports.py), said once per field on the rank's stderr
    try:
        clean = clean_report(
            iteration, time.time(), total=total, loss=loss, tokens=tokens, lr=lr, flops=flops
        )
        for dropped in clean.dropped:
            if dropped.field not in _said:
                _said.add(dropped.field)
                print(
                    f"megaray: {dropped.describe()} (said once for {dropped.field})",
                    file=sys.stderr,
                    flush=True,
                )
        if clean.record is not None:  # sent with the next turn of the output thread
            _current.reports.append((int(os.environ.get("RANK", "0")), clean.record))
    except Exception as e:  # the sink gone with the driver, or a value whose conversion raised oddly
        if "report" not in _said:
            _said.add("report")
            print(f"megaray: report() was not sent: {type(e).__name__}: {e}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def checkpointing(iteration: int, loading: bool = False) -> Iterator[None]:
    """Around a plain program's checkpoint save (or load, `loading`), from any rank: the launch's
    goodput ledger counts its time as checkpoint, not training (Megatron-Bridge's own lines say it
    for its targets), and its save cost sets the interval advised at the end. A save that raises is
    not counted as done. Outside a megaray launch this does nothing, as `report()`.

        with checkpointing(step):
            torch.save(state, path)
    """
    start, end = (Phase.LOADING, Phase.LOADED) if loading else (Phase.SAVING, Phase.SAVED)
    _checkpoint(start, iteration)
    yield
    _checkpoint(end, iteration)


def _checkpoint(phase: Phase, iteration: int) -> None:
    if current_sink() is None or _current.stopped:
        return
    with contextlib.suppress(Exception):  # never the program's failure (a value that is no number)
        record = {"checkpoint": int(iteration), "phase": phase.value, "time": time.time()}
        _current.reports.append((int(os.environ.get("RANK", "0")), record))
