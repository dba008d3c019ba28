"""In a rank: how often its program is waiting inside a collective, for the driver's straggler
detection (core/straggler.py).

A thread looks at the program's thread ten times a second (`sys._current_frames`, a few
microseconds, no signal, no ptrace) and counts the looks that find a `torch.distributed`
collective on its stack; every few seconds it sends the counts to its node's forwarder. Waiting in
a collective releases the GIL (gloo's and NCCL's waits do), so the looks land where the program is.

Not seen this way: a collective whose wait happens in C++ without a Python frame of
`torch.distributed` on the stack (DDP's gradient all-reduce inside `backward()`, NCCL's kernels on
a GPU, which the CPU waits for at a later synchronisation).
"""

from __future__ import annotations

import random
import sys
import threading
import time
from typing import Any

from ..core.straggler import WaitSample

LOOK_EVERY_S = 0.1
SEND_EVERY_S = 2.5  # at most 400 sends a second reach the sink, however many ranks (send_every)
COLLECTIVE_FILES = ("torch/distributed/distributed_c10d.py",)
MAX_DEPTH = 64


def in_collective(frame: Any) -> bool:
    """Whether a frame on this stack is a function of torch.distributed's collectives module."""
    depth = 0
    while frame is not None and depth < MAX_DEPTH:
        if frame.f_code.co_filename.endswith(COLLECTIVE_FILES):
            return True
        frame, depth = frame.f_back, depth + 1
    return False


def gpu_memory() -> tuple[int, int] | None:
    """torch's GPU memory allocated and reserved on this rank's (first visible) device, where the
    program has initialised CUDA; counters torch keeps, read without a synchronisation. torch is not
    imported here for a program that did not."""
    torch = sys.modules.get("torch")
    try:
        if torch is None or not torch.cuda.is_initialized():
            return None
        return int(torch.cuda.memory_allocated()), int(torch.cuda.memory_reserved())
    except Exception:  # a broken CUDA context is the program's to report, not this thread's
        return None


def send_every(world_size: int) -> float:
    return max(SEND_EVERY_S, world_size / 400)


class WaitSampler:
    """Looks at the thread `thread_id` until `stop()`; sends `(samples, waiting)` to `sink` (which
    stamps them with its own clock: the nodes' clocks need not agree)."""

    def __init__(self, sink: Any, rank: int, thread_id: int, world_size: int):
        self.sink, self.rank, self.thread_id = sink, rank, thread_id
        self.every = send_every(world_size)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="megaray-waits", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        samples = waiting = 0
        next_send = time.monotonic() + self.every
        # at random moments: looks at a fixed period alias with a program's own period (a 0.2 s step
        # looked at every 0.1 s showed its peers waiting 51% of the time, not 75%)
        while not self.done.wait(random.uniform(0.5, 1.5) * LOOK_EVERY_S):
            frame = sys._current_frames().get(self.thread_id)
            if frame is None:
                continue
            samples += 1
            waiting += in_collective(frame)
            del frame
            if time.monotonic() >= next_send:
                try:
                    self.sink.sample.remote(WaitSample(self.rank, 0.0, samples, waiting, gpu_memory()))
                except Exception:  # the sink is gone with the driver
                    return
                samples = waiting = 0
                next_send = time.monotonic() + self.every

    def stop(self) -> None:
        self.done.set()
