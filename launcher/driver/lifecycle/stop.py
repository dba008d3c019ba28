"""How the driver is told to stop: SIGINT/SIGTERM remembered by a handler and acted on by every wait
loop of the driver (placement, actor start, supervision, teardown)."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator

from ...core.errors import Interrupted


class StopSignal:
    """SIGINT/SIGTERM in the driver: remembered by the handler, acted on by the wait loops.

    Raising from the handler would unwind through Ray's C++ wait and surface as a SystemError; the
    loops wait in short slices and call `check()`, which raises `Interrupted` so teardown runs. A
    signal is acted on once: the waits of the teardown that follows (the ranks' --kill-grace to end on
    their SIGTERM) go on, and only a second signal cuts them short.
    """

    def __init__(self, also: Callable[[], object] | None = None):
        """`also`: asked at every check too, and may raise to end the launch the same way (the
        preflight's refusal, arriving while the driver places or starts the ranks)."""
        self.signum: int | None = None
        self.received = 0  # signals the handler saw
        self.acted_on = 0  # of those, raised as Interrupted
        self.also = also

    def check(self) -> None:
        if self.received > self.acted_on:
            self.acted_on = self.received
            raise Interrupted(self.signum, signal.Signals(self.signum).name)
        if self.also is not None:
            self.also()

    def receive(self, signum: int) -> None:
        """What the handler does; a second signal while stopping stops waiting for anything."""
        self.received += 1
        if self.signum is not None:
            self.acted_on = self.received
            raise Interrupted(signum, signal.Signals(signum).name)
        self.signum = signum

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        old = {
            s: signal.signal(s, lambda signum, _frame: self.receive(signum))
            for s in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)


class EarlyInterrupt:
    """Ctrl-C before a launch's StopSignal is installed: the preflight's imports, connecting.

    Python's own handler raises KeyboardInterrupt wherever the main thread is; raised inside a
    weakref callback or a `__del__` (imports run many), it is printed as "Exception ignored" and lost.
    Seen in CI: Ctrl-C 3 s into the preflight, and the preflight went on and the job launched. This
    handler raises it the same way and also remembers it, so `check()` at the next step raises it
    again, and the lost one's traceback is not printed. A Ctrl-C lost that way can also have cut an
    import short, so that the next import fails on what it left (a fresh-clone run, 3 s into
    bridge's import under `--check`: numpy half set up, then an AttributeError's traceback and exit
    1): any error that leaves the block once a Ctrl-C came is the Ctrl-C's, and is raised as it.
    """

    def __init__(self):
        self.received = False
        self._holding = False  # inside `held()`: a first Ctrl-C is remembered, not raised

    def check(self) -> None:
        if self.received:
            raise KeyboardInterrupt

    def _handle(self, _signum, _frame) -> None:
        first = not self.received
        self.received = True
        if self._holding and first:
            return
        raise KeyboardInterrupt

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Around starting a Ray in this process (`ray.init(address="local")`, a simulated cluster's
        nodes): a first Ctrl-C is acted on once the start returns, and the Ray just started is then
        stopped as after any Ctrl-C. Raised inside the start, a KeyboardInterrupt unwinds through Ray
        half set up (its processes started, its node not yet its driver's), or, raised in a callback,
        is lost there: CI saw a driver given Ctrl-C 3 s into a local launch say nothing more for
        60 s, its last line "starting a local Ray". The start is bounded (Ray gives its node 30 s);
        a second Ctrl-C is raised at once, as Python's own handler would."""
        if signal.getsignal(signal.SIGINT) != self._handle:  # not installed (not the main thread)
            yield
            return
        self._holding = True
        try:
            yield
        finally:
            self._holding = False
        self.check()

    @contextlib.contextmanager
    def installed(self) -> Iterator[EarlyInterrupt]:
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        old_handler = signal.signal(signal.SIGINT, self._handle)
        old_hook = sys.unraisablehook

        def hook(unraisable) -> None:
            if not (self.received and issubclass(unraisable.exc_type, KeyboardInterrupt)):
                old_hook(unraisable)

        sys.unraisablehook = hook
        try:
            yield self
        except Exception:
            if self.received:  # what the Ctrl-C broke, before `check()` could say it came
                raise KeyboardInterrupt from None
            raise
        finally:
            signal.signal(signal.SIGINT, old_handler)
            sys.unraisablehook = old_hook
