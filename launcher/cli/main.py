"""`megaray` / `python main.py`: parse, launch, map the outcome to an exit code and one clear message."""

from __future__ import annotations

import logging
import math
import os
import statistics
import sys

from ..core.errors import MegarayError, RankFailedError
from ..core.launch_args import spec_from_args
from ..core.target import dry_run_trains
from .commands import COMMANDS, commands_help

log = logging.getLogger("megaray")


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time (tests and notebooks swap it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value):
        pass


class _Formatter(logging.Formatter):
    """`megaray: ...`, and `megaray: error: ...` for errors, so a failure's line can be found in logs."""

    def format(self, record: logging.LogRecord) -> str:
        prefix = "megaray: error: " if record.levelno >= logging.ERROR else "megaray: "
        return prefix + record.getMessage()


def _setup_logging() -> None:
    if not log.handlers:
        handler = _StderrHandler()
        handler.setFormatter(_Formatter())
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def entry() -> None:
    """`megaray`, `python main.py`, `python -m launcher`: `main()`, then the process ends at once.

    When main() returns, every rank has ended, the launch's actors and groups are gone and the run
    directory is written: the exit code is final. What Python would still do is shut the driver's
    Ray connection down and tear the interpreter's modules down (Ray's, and bridge's after a
    preflight), about half a second that a developer waiting for the prompt would wait in vain.
    """
    code = main(exits_after=True)
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def main(argv: list[str] | None = None, *, exits_after: bool = False) -> int:
    """Exit codes: 0 every rank returned; 1 a rank failed; 2 bad input or resources; 130/143 stopped.
    `exits_after`: the process ends when this returns (`entry`), so nothing need be shut down first."""
    _setup_logging()
    # Ray reads this when it is imported: without it, identical lines from several ranks are folded
    # into one "[repeated Nx across cluster]" and per-rank output is lost.
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv and argv[0] in COMMANDS:
            return COMMANDS[argv[0]].run(argv[0], argv[1:], exits_after)
        spec = spec_from_args(argv, help_epilog=commands_help())
        if spec.check_only:
            from ..driver.lifecycle.stop import EarlyInterrupt
            from ..megatron.preflight import preflight

            with EarlyInterrupt().installed() as early:
                # a process that ends once checked runs no kernel; main() called from Python may train
                # in its process afterwards, and keeps torch's compiler
                preflight(spec, kernels=not exits_after)
                early.check()  # a Ctrl-C its imports swallowed
            return 0
        from ..driver.lifecycle.launch import (
            launch,  # imports ray: after the spec, so --help and bad input stay fast
        )

        result = launch(spec, exits_after=exits_after)
        if spec.dry_run:
            nodes = len(result.returns) // spec.gpus_per_node  # with --nodes MIN:MAX, the last attempt's
            return _report_dry_run(result.returns, nodes, dry_run_trains(spec.target.args))
    except RankFailedError as e:
        print(e.report(), file=sys.stderr, flush=True)
        return e.exit_code
    except MegarayError as e:
        log.error("%s", e)
        return e.exit_code
    except KeyboardInterrupt:  # Ctrl-C where nothing was placed yet (parsing, a preflight)
        log.error("interrupted by SIGINT before anything was placed")
        return 130
    return 0


LOSS_TAIL = 5  # the dry run's training ends at the median loss of its last this many steps


def _report_dry_run(views: list[dict], nodes: int, asked_to_train: bool = True) -> int:
    """`asked_to_train` is False for `--dry-run steps=0`, the rendezvous check alone."""
    log.info(
        "dry run passed: %d ranks on %d node(s) joined %s over gloo, all-reduce gave %d on every rank, "
        "LOCAL_RANK unique per node",
        len(views),
        nodes,
        views[0]["master"],
        views[0]["all_reduce"],
    )
    trained = [v["training"] for v in views if v.get("training") and v["training"]["losses"]]
    if not trained and not asked_to_train:
        return 0
    if not trained:
        from ..megatron.tiny_gpt import choose_layout

        tp, pp, dp = choose_layout(len(views), views[0]["local_world_size"])
        log.info(
            "megatron-core is not installed, so no Megatron training ran; with the megatron extra "
            "(pip install -e '.[megatron]') this dry run would also train a tiny Megatron GPT with "
            "TP %d x PP %d x DP %d over gloo across the %d ranks and print its loss",
            tp, pp, dp, len(views),
        )  # fmt: skip
        return 0
    first = trained[0]
    curve = first["losses"]
    # The TP ranks of the last pipeline stage compute one loss together: within a data-parallel
    # replica they must report the same. Replicas train on different data, so their losses differ.
    for other in trained[1:]:
        ref = next(t for t in trained if t.get("dp_rank", 0) == other.get("dp_rank", 0))
        theirs = other["losses"]
        if len(theirs) != len(ref["losses"]) or any(
            abs(a - b) > 1e-3 * abs(a) for a, b in zip(ref["losses"], theirs, strict=False)
        ):
            log.error("dry run failed: ranks %d and %d disagree on the loss: %s vs %s",
                      ref["rank"], other["rank"], ref["losses"], theirs)  # fmt: skip
            return 1
    shown = " ".join(_loss(x) for x in curve[:: max(1, len(curve) // 5)])
    # where it ended: the median of the last steps, as one batch's loss is noisy (a run on text ended
    # on a hard batch at 6.88 after reaching 6.05) and one batch of text can be far off (8.48 among
    # 6.0-6.2: it pulled the mean of the last five from 6.05 to 6.55)
    tail = curve[-LOSS_TAIL:]
    log.info(
        "Megatron GPT trained on CPU with TP %d x PP %d x DP %d: loss %s -> %s over %d steps (%s; the "
        "end: the median of the last %d); last-stage ranks agreeing: %d",
        first["tp"], first["pp"], first["dp"], _loss(curve[0]), _loss(statistics.median(tail)), len(curve),
        shown, len(tail), len(trained),
    )  # fmt: skip
    return 0


def _loss(x: float) -> str:
    """Two decimals, or two significant digits below 0.1, in plain digits: a loss trained down to
    0.0001 (a resumed run's) read "0.00 -> 0.00"."""
    if not math.isfinite(x) or abs(x) >= 0.1 or x == 0:
        return f"{x:.2f}"
    return f"{x:.{1 - math.floor(math.log10(abs(x)))}f}"


def job_driver(want_ray: str, want_python: str) -> int:
    """The launch inside a submitted job (after BOOTSTRAP imported this), once the job's interpreter is
    known to have the client's Ray and Python."""
    import ray

    from ..core.versions import python_version
    from .jobspec import ENV_FIX

    here = python_version()
    if (ray.__version__, here.rsplit(".", 1)[0]) != (want_ray, want_python):
        print(
            f"megaray: error: the job runs {sys.executable} with Ray {ray.__version__} and Python {here}; "
            f"megaray submit has Ray {want_ray} and Python {want_python}: {ENV_FIX}",
            file=sys.stderr,
        )
        return 2
    argv = sys.argv[1:]
    if not any(a == "--runs-dir" or a.startswith("--runs-dir=") for a in argv):
        argv = ["--runs-dir", job_runs_dir(), *argv]
    return main(argv)


def job_runs_dir() -> str:
    """Where a submitted job's run directories go on the head: not under its working directory, which
    is Ray's copy of the upload, shared by the raylets of one machine (a second raylet unpacking it
    again removed a run directory being written) and deleted when Ray evicts it."""
    import tempfile

    return os.path.join(tempfile.gettempdir(), f"megaray-runs-{os.getuid()}")
