"""The run directory, `runs/<job>/`: what was asked, where it ran, what each rank got, how it ended.

Written by the driver as the launch goes, so a failed or interrupted run leaves the same record
as a good one. Values of variables whose names suggest a secret are replaced before anything is
written or printed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ...core.errors import UsageError
from ...core.rankenv import redact

log = logging.getLogger("megaray")


def _jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, str | int | float | bool) or obj is None:
        return obj
    return str(obj)


def spec_record(spec: Any) -> dict[str, Any]:
    """The launch spec as JSON, with the secrets of `--env` and of the shell's variables redacted."""
    record = _jsonable(spec)
    record["env"] = redact(dict(spec.env))
    record["forwarded"] = redact(dict(spec.forwarded))  # the launching shell's: secrets among them
    record["world_size"] = spec.world_size
    return record


def _not_a_folder(root: Path, why: str) -> UsageError:
    return UsageError(
        f"--runs-dir {root.parent} cannot hold run directories ({why}); give a folder path you can "
        "write, or leave --runs-dir out for ./runs"
    )


def runs_root(root: Path) -> None:
    """Make the folder the run directory `root` goes in, or fail in one line (bad input): said before
    the launch connects, while the run directory itself is made only once it has."""
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise _not_a_folder(root, "a file is in the way") from None
    except OSError as e:
        raise _not_a_folder(root, e.strerror or str(e)) from None
    if not os.access(root.parent, os.W_OK | os.X_OK):
        raise _not_a_folder(root, "not writable here")


def private_dir(root: Path) -> Path:
    """A new folder only this user can read: `root`, or `root.1`, `root.2`, ... when a launch of the
    same job name left one, so that no two launches ever share a run directory."""
    path, n = root, 0
    while True:
        try:
            path.mkdir(parents=True, mode=0o700)
            return path
        except FileExistsError:
            n += 1
            path = root.with_name(f"{root.name}.{n}")
        except NotADirectoryError:
            raise _not_a_folder(root, "a file is in the way") from None


class RunDir:
    """Files are written whole (a reader never sees half a file) and private to the user: they hold
    each rank's environment."""

    def __init__(self, root: Path):
        self.path = private_dir(root)
        self.started = time.time()

    def write_json(self, name: str, data: Any) -> None:
        text = json.dumps(_jsonable(data), indent=2) + "\n"
        self._write(name, lambda tmp: tmp.write_text(text))

    def _write(self, name: str, write: Callable[[Path], Any]) -> None:
        """`write(path)` into a private temporary file, then renamed to `name`. A write that fails (a
        full disk, the run directory deleted or read-only) is said, and the run goes on: the files
        record the run, whose outcome is the training's, as under torchrun, which writes none."""
        tmp = self.path / f".{name}.tmp"
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
            write(tmp)
            tmp.replace(self.path / name)
        except OSError as e:
            log.warning("%s could not be written in the run directory %s (%s): the run goes on without it",
                        name, self.path, e.strerror or e)  # fmt: skip
            with contextlib.suppress(OSError):
                tmp.unlink()

    def write_spec(self, spec: Any) -> None:
        self.write_json("spec.json", spec_record(spec))

    def write_config(self, text: str) -> None:
        """The resolved Megatron-Bridge config, as bridge itself writes it (megatron/preflight.py)."""
        self._write("config.yaml", lambda tmp: tmp.write_text(text))

    def write_topology(
        self, master: tuple[str, int], ranks: list[dict[str, Any]], nodes: dict[str, Any] | None = None
    ) -> None:
        """`nodes`: with --nodes MIN:MAX, how many this attempt runs on, and why."""
        extra = {"nodes": nodes} if nodes else {}
        record = {"master_addr": master[0], "master_port": master[1], **extra, "ranks": ranks}
        self.write_json("topology.json", record)

    def write_env(self, per_rank: list[dict[str, Any]]) -> None:
        self.write_json("env.json", per_rank)

    def write_summary(self, **fields: Any) -> None:
        ended = time.time()
        self.write_json(
            "summary.json",
            {
                **fields,
                "started_at": self.started,
                "ended_at": ended,
                "duration_s": round(ended - self.started, 3),
            },
        )
