"""The preflight of a launch, in a process of its own, so that nothing waits for it before training.

Building a recipe's config imports Megatron-Bridge (11-36 s on GPU machines) and the ranks import it
again; torchrun pays that once. Here the driver starts this process first, then connects, places
and starts the ranks, which import their stack meanwhile; the ranks' program starts once the verdict
is in (driver/lifecycle/launch.py), and a refusal ends the launch with its one line, exit 2, nothing left.

Its own process, not a thread: the import is seconds of Python holding the GIL the driver's loops
need; like `--check`, it sees no GPU (preflight.py `no_gpu_visible`), so that importing bridge never
makes a CUDA context on a GPU the ranks are about to use. It ends when it has answered; the driver
ends it first if the launch ends before (`cancel`). Where its start was put off (no core to spare)
and the launch then waits for it, a driver that has bridge imported already answers itself.

    python -m launcher.megatron.preflight_process DIR   # reads DIR/spec.pkl, writes DIR/verdict.pkl
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from ..core.errors import MegarayError
from ..core.runner import Answer, Verdict
from ..core.spec import LaunchSpec
from .preflight import Plan

log = logging.getLogger("megaray")

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the folder `launcher` is in
STDERR_TAIL = 5  # lines of a crashed preflight's output shown
PREFLIGHT_NICENESS = 19  # the lowest: below the ranks (0 on nodes megaray starts, Ray's default 15)
# Where this process would take a core from the ranks, it waits this long for rank 0 to start
# importing (then rank 0 answers), counted from the first look once connected (a local Ray's start
# took over 10 s beside the suite's other worker); a launch still placing by then (an autoscaler
# adding nodes) gets it, so that a layout that cannot run is still refused while the cluster grows.
DEFER_S = 10.0


def starts_at_once(cores: int, ranks_per_node: int) -> bool:
    """Whether the preflight's process starts with the launch. It imports what the ranks import: on a
    machine with no core to spare beside them (the driver's, one per rank, and its own), where a
    one-node launch puts its ranks, it slowed their imports by as much as it saved (+2.85 s to a
    `gpt_small` launch on 2 cores, `bench/preflight_path.py`), while rank 0, its imports done,
    answers in about a second. With a core to spare it starts at once and races rank 0."""
    return cores >= ranks_per_node + 2


def bridge_installed() -> bool:
    """Without bridge where the driver runs, the launch goes on unchecked (`find_spec` of a dotted
    name imports its parent: the top-level name first)."""
    return find_spec("megatron") is not None and find_spec("megatron.bridge") is not None


class PreflightProcess(Verdict[Plan]):
    """The verdict of `python -m launcher.megatron.preflight_process`, started by `start()`."""

    in_background = True

    def __init__(self, folder: str, spec: LaunchSpec):
        super().__init__()
        self.folder, self.spec = folder, spec
        self.proc: subprocess.Popen | None = None  # started by `_start`, at once or when due
        self._since: float | None = None  # the first look (`ready`), once the driver is connected
        self._error: MegarayError | None = None
        self._done = False
        self._rank: tuple[Any, Any] | None = None  # a rank process that may answer, once `after` is
        self._asked: Any = None  # its answer, on its way
        self._asked_at = 0.0
        self._needed = False  # the answer is waited for and no rank is working it out: start now

    @classmethod
    def start(cls, spec: LaunchSpec) -> Verdict:
        if not bridge_installed():
            log.warning(
                "preflight skipped: no megatron-bridge in the driver (install megaray[megatron] to check "
                "layouts here)"
            )
            return Verdict()
        folder = tempfile.mkdtemp(prefix="megaray-preflight-")
        with open(os.path.join(folder, "spec.pkl"), "wb") as f:
            pickle.dump(spec, f)
        verdict = cls(folder, spec)
        if starts_at_once(os.cpu_count() or 1, spec.gpus_per_node):
            verdict._start()
        return verdict

    def _start(self) -> None:
        if self._needed and "megatron.bridge" in sys.modules:
            self._answer_here()
            return
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # as preflight.py `no_gpu_visible` makes it
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
        with open(os.path.join(self.folder, "output"), "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", __name__, self.folder], stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, env=env,
                start_new_session=True,  # a Ctrl-C is the driver's to act on; it ends this one
            )  # fmt: skip
        # Where it shares the cores with the ranks anyway, their imports go first
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, self.proc.pid, PREFLIGHT_NICENESS)

    def _answer_here(self) -> None:
        """The launch waits for the verdict, and this process has bridge imported already (a notebook,
        a Python-API caller that built a config): the config takes about a second to build here,
        where a process of its own would import bridge again first (~10 CPU-s, 8-30 s)."""
        t0 = time.monotonic()
        verdict = answer(self.spec)
        shutil.rmtree(self.folder, ignore_errors=True)
        self._done = True
        log.info("preflight in the driver, bridge imported here (%.1f s)", time.monotonic() - t0)
        self._take(*verdict)

    def _due(self) -> bool:
        """Whether the process not started yet must start: no rank is working the answer out, and
        it is waited for, or rank 0 has not started importing within DEFER_S."""
        nobody = self._rank is None and self._asked is None
        if self._since is None:
            self._since = time.monotonic()
        return nobody and (self._needed or time.monotonic() - self._since >= DEFER_S)

    def result(self, wait: Any = lambda: None, poll_s: float = 0.05) -> Any:
        self._needed = True
        return super().result(wait, poll_s)

    def ready(self) -> bool:
        running = self.proc is None or self.proc.poll() is None
        if not self._done and running and self._rank is not None:
            self._ask_rank()
        if not self._done and self.proc is None and self._due():
            self._start()
        if not self._done:
            if self.proc is None or self.proc.poll() is None:
                return False
            self._done = True
            self._read()
        if self._error is not None:
            self.refusal, self._error = self._error, None
            raise self.refusal
        return True

    def ask(self, process: Any, after: Any = None) -> None:
        """A rank's process with bridge imported builds the config in about a second: a warm pool's
        (`after` None), or a rank's once its imports are done (`after`: that call's result). When it
        can before this process answers, it answers instead and this process is ended. Once this
        process has answered, the rank is not asked (its next call is its program); a call already
        sent runs to its end there, a second before the program."""
        self._rank = (process, after)
        self.ready()

    def _ask_rank(self) -> None:
        """Asked at every poll, never waiting: the rank's call goes out once its imports are done,
        and its answer is taken once in (the driver's stop checks go on meanwhile)."""
        import ray

        process, after = self._rank
        if self._asked is None:
            if after is None or ray.wait([after], timeout=0)[0]:
                self._asked_at = time.monotonic()
                self._asked = process.call.remote(answer, (self.spec, True), {})
            return
        if not ray.wait([self._asked], timeout=0)[0]:
            return
        ref, self._asked, self._rank = self._asked, None, None
        try:
            outcome = ray.get(ref)
        except ray.exceptions.RayError as e:  # the rank's own failure is the launch's to see
            log.debug("the rank's process did not answer for the preflight: %s", e)
            return
        # a rank that could not build it (its imports failed) leaves the answer to this process
        if not outcome.ok or outcome.value[0] is Answer.CRASHED:
            return
        self.cancel()
        self._done = True
        where = "a warm pool's process" if after is None else "rank 0's process"
        log.info("preflight in %s, bridge imported there (%.1f s)", where, time.monotonic() - self._asked_at)
        self._take(*outcome.value)

    def cancel(self) -> None:
        if self.proc is not None and self.proc.poll() is None:  # our own child, by its Popen
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)

    def _read(self) -> None:
        try:
            with open(os.path.join(self.folder, "verdict.pkl"), "rb") as f:
                kind, value, records = pickle.load(f)
        except (OSError, EOFError, pickle.UnpicklingError, ValueError):
            kind, value, records = Answer.CRASHED, _tail(os.path.join(self.folder, "output")), []
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)
        self._take(kind, value, records)

    def _take(self, kind: Answer, value: Any, records: list[tuple[int, str]]) -> None:
        for level, message in records:  # its lines, as the driver would have logged them
            log.log(level, "%s", message)
        if kind is Answer.PLAN:
            self._plan = value
        elif kind is Answer.REFUSED:
            self._error = value
        else:
            where = f"exit {self.proc.returncode}" if self.proc is not None else "in the driver"
            told = value or "no output"
            log.warning("preflight failed (%s): %s; the ranks build the config themselves", where, told)


def _tail(path: str) -> str:
    try:
        lines = [line for line in Path(path).read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return " | ".join(lines[-STDERR_TAIL:])


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.levelno, record.getMessage()))


def answer(
    spec: LaunchSpec, in_rank: bool = False, ends_after: bool = False
) -> tuple[Answer, Any, list[tuple[int, str]]]:
    """The verdict where this runs, as (kind, plan or error, the lines it logged): in the driver, in
    this module's process (`ends_after`: it ends once it has answered, so `torch.compile` is left off
    while bridge imports, preflight.py `preflight`), or (`in_rank`) in rank 0's, which has bridge
    imported (`PreflightProcess.ask`) and whose GPU stays visible."""
    from .preflight import preflight

    handler = _Records()
    saved = (log.level, log.propagate)
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    try:
        return Answer.PLAN, preflight(spec, hide_gpus=not in_rank, kernels=not ends_after), handler.records
    except MegarayError as e:
        return Answer.REFUSED, e, handler.records
    except Exception:
        return Answer.CRASHED, traceback.format_exc().strip().splitlines()[-1], handler.records
    finally:
        log.removeHandler(handler)
        log.setLevel(saved[0])
        log.propagate = saved[1]


def child(folder: str) -> int:
    # an import that makes ~800,000 objects it keeps, in a process that ends once it has answered:
    # the collector's walks over them are time for nothing (rank/warmup.py `collector_paused`)
    gc.disable()
    with open(os.path.join(folder, "spec.pkl"), "rb") as f:
        spec: LaunchSpec = pickle.load(f)
    verdict = answer(spec, ends_after=True)  # without torch's compiler: this process runs no kernel
    path = os.path.join(folder, "verdict.pkl")
    with open(path + ".tmp", "wb") as f:
        pickle.dump(verdict, f)
    os.replace(path + ".tmp", path)
    return 0


if __name__ == "__main__":
    code = child(sys.argv[1])
    sys.stdout.flush()
    os._exit(code)  # bridge's modules need no tear-down: the verdict is written
