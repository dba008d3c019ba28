"""In a rank of the Megatron target: how long each forward step takes, for the driver's straggler
detection (core/straggler.py `StepDetector`).

megaray hands the training loop its forward step (bridge's `forward_step`, the dry run's own), so it
can time it without any change to the training code. On a GPU the time is the device's, between two
CUDA events around the step, read once the device has passed them (`query()`, never a
synchronisation): the CPU only queues the work, and on a GPU it does not wait in the collectives
either, which is why looks at its stack (rank/waits.py) cannot tell who is slow there. On a CPU it is
the wall-clock time of the call. The schedule's pipeline sends and receives and the gradient
all-reduce run outside the forward step; a tensor-parallel all-reduce runs inside it, so a slow
rank's tensor-parallel peers wait for it in their forward steps and are slow with it.

Every few seconds the rank sends what it timed (steps, seconds, its pipeline stage) to its node's
forwarder, from the training thread (a call that does not wait for an answer).
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from ..core.straggler import StepSample, stragglers_off
from ..rank.capture import current_sink
from ..rank.waits import gpu_memory, send_every

MAX_PENDING = 256  # forward steps queued on the device and not yet timed; older ones are not timed


def timed(forward_step: Callable, sink: Any = None) -> Callable:
    """`forward_step`, timed for straggler detection in a megaray launch (its samples go to `sink`,
    the rank's node forwarder by default); unchanged outside one and with `--env
    MEGARAY_STRAGGLERS=off`. The wrapper keeps its signature (`functools.wraps`): bridge reads it to
    decide whether to pass its GlobalState."""
    sink = sink if sink is not None else current_sink()
    if sink is None or stragglers_off(os.environ):
        return forward_step
    timer = StepTimer(sink, int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")))

    @functools.wraps(forward_step)
    def forward_step_timed(*args: Any, **kwargs: Any) -> Any:
        return timer.call(forward_step, args, kwargs)

    return forward_step_timed


class StepTimer:
    def __init__(self, sink: Any, rank: int, world_size: int, clock: Callable[[], float] = time.monotonic):
        self.sink, self.rank, self.clock = sink, rank, clock
        self.every = send_every(world_size)
        self.next_send = clock() + self.every
        self.steps, self.seconds = 0, 0.0
        self.pending: deque[tuple[Any, Any]] = deque()  # (start, end) CUDA events not yet passed
        self.cuda: bool | None = None  # decided at the first step, once the target has set up CUDA
        self.stage: int | None = None  # its pipeline stage, read at the first send
        self.place = 0  # its tensor- and context-parallel ranks, as one number (core/straggler.py)

    def call(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        import torch

        if self.cuda is None:
            self.cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        if not self.cuda:
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            self.add(time.perf_counter() - t)
            return out
        if torch.cuda.is_current_stream_capturing():  # a CUDA graph being recorded: no events in it
            return fn(*args, **kwargs)
        self.collect()
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn(*args, **kwargs)
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self.pending.append((start, end))
        while len(self.pending) > MAX_PENDING:
            self.pending.popleft()
        return out

    def collect(self) -> None:
        """The steps the device has finished since the last look, timed."""
        while self.pending and self.pending[0][1].query():
            start, end = self.pending.popleft()
            self.add(start.elapsed_time(end) / 1000)

    def add(self, seconds: float) -> None:
        self.steps += 1
        self.seconds += seconds
        if self.clock() >= self.next_send:
            self.send()

    def send(self) -> None:
        if self.stage is None:
            self.stage, self.place = _coordinates()
        with contextlib.suppress(Exception):  # the sink is gone with the driver: training goes on
            memory = gpu_memory() if self.cuda else None
            sample = StepSample(self.rank, 0.0, self.stage, self.steps, self.seconds, memory, self.place)
            self.sink.sample.remote(sample)
        self.steps, self.seconds = 0, 0.0
        self.next_send = self.clock() + self.every


def _coordinates() -> tuple[int, int]:
    """The rank's pipeline stage and its place in the stage's model shard (tensor-parallel rank x
    context-parallel size + context-parallel rank): its straggler peers' key (core/straggler.py
    `StepSample`). (0, 0) before Megatron's parallel state exists."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 0, 0
    place = ps.get_tensor_model_parallel_rank() * ps.get_context_parallel_world_size()
    return ps.get_pipeline_model_parallel_rank(), place + ps.get_context_parallel_rank()
