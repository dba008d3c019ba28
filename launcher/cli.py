"""`megaray` / `python main.py`: parse, launch, map the outcome to an exit code and one clear message."""

from __future__ import annotations

import logging
import os
import sys

from .errors import MegarayError, RankFailedError
from .spec import spec_from_args

log = logging.getLogger("megaray")


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time (tests and notebooks swap it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value):
        pass


def _setup_logging() -> None:
    if not log.handlers:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("megaray: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 every rank returned; 1 a rank failed; 2 bad input or resources; 130/143 stopped."""
    _setup_logging()
    # Ray reads this when it is imported: without it, identical lines from several ranks are folded
    # into one "[repeated Nx across cluster]" and per-rank output is lost.
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    try:
        spec = spec_from_args(sys.argv[1:] if argv is None else argv)
        if spec.check_only:
            from .preflight import preflight

            preflight(spec)
            return 0
        from .launch import launch  # imports ray: after the spec, so --help and bad input stay fast

        result = launch(spec)
        if spec.dry_run:
            views = result.returns
            log.info(
                "dry run passed: %d ranks on %d node(s) joined %s over gloo, all-reduce gave %d on "
                "every rank, LOCAL_RANK unique per node",
                result.world_size,
                spec.nodes,
                views[0]["master"],
                views[0]["all_reduce"],
            )
    except RankFailedError as e:
        print(e.report(), file=sys.stderr, flush=True)
        return e.exit_code
    except MegarayError as e:
        log.error("%s", e)
        return e.exit_code
    return 0
