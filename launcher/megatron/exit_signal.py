"""SIGTERM as Megatron-Bridge takes it with `train.exit_signal_handler`, for the dry run's trainer.

Bridge (training/utils/sig_utils.py `DistributedSignalHandler`, training/train.py) sets a flag when
the signal comes, asks every rank for theirs after each step, and when any rank got it saves a
checkpoint (where saving is configured), says so and leaves the training loop: the program ends
with exit 0, and a relaunch resumes from that checkpoint. A preemption notice, a scheduler's stop or
a test ends a run the same way at any pace: the dry run's `exit_signal_handler=true` does the same.
"""

from __future__ import annotations

import signal
import threading
from typing import Any


class ExitSignal:
    """`with ExitSignal() as stop:` the signal sets a flag (the handler is installed only in the
    main thread, where Python runs handlers; elsewhere the flag stays down, as Bridge's does);
    `stop.agreed()`, called by every rank at the same step, says whether any rank got it. The
    handler that was there before is put back on leaving."""

    def __init__(self, sig: int = signal.SIGTERM):
        self.sig = sig
        self.received = False
        self._before: Any = None
        self._installed = False

    def __enter__(self) -> ExitSignal:
        if threading.current_thread() is threading.main_thread():
            self._before = signal.signal(self.sig, self._handle)
            self._installed = True
        return self

    def __exit__(self, *_: object) -> None:
        if self._installed:
            signal.signal(self.sig, self._before)
            self._installed = False

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = True  # nothing printed here: a print interrupted by the handler would raise

    def agreed(self) -> bool:
        """Whether any rank of the default process group got the signal (a collective: every rank calls
        it at the same step)."""
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1 if self.received else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
