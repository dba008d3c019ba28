"""Plain programs on a rank, run as torchrun runs them: a script or a module as `__main__` with
`sys.argv` set and the program's own folder first on `sys.path`, or a `pkg.module:function`."""

from __future__ import annotations

import logging
import os
import runpy
import socket
import sys
from pathlib import Path
from typing import Any

from ..core.errors import UsageError
from ..core.refs import load_function, split_ref
from ..core.runner import TargetRunner
from ..core.target import Target, TargetKind, check_importable, check_script
from .plain_process import fresh_sys_path, use_own_modules

log = logging.getLogger("megaray")


class TargetNotFound(Exception):
    pass


class ScriptRunner(TargetRunner[None]):
    def check_locally(self, target: Target, cwd: str) -> None:
        check_script(target.name, cwd)

    def check_submitted(self, target: Target, local_dir: str | None, uploads: bool) -> None:
        """A script named by a relative path must be in the uploaded folder."""
        if os.path.isabs(target.name):
            return
        if not uploads:
            raise UsageError(
                f"script {target.name} is a relative path but nothing is uploaded: add --working-dir with "
                "the folder that holds it"
            )
        if local_dir:
            self.check_locally(target, str(Path(local_dir).resolve()))

    def main(self, target: Target, cwd: str) -> None:
        path = os.path.join(cwd, target.name)
        if not os.path.isfile(path):
            raise TargetNotFound(
                f"script {path} does not exist on node {socket.gethostname()}; put it on every node "
                "(shared filesystem or the same checkout)"
            )
        sys.argv = [path, *target.args]
        use_own_modules(fresh_sys_path(os.path.dirname(path)))
        runpy.run_path(path, run_name="__main__")


class _Importable(TargetRunner[None]):
    """A module or an entrypoint: found from the working folder or the installed packages."""

    flag = ""

    def check_locally(self, target: Target, cwd: str) -> None:
        check_importable(target.name, cwd, self.flag)

    def check_submitted(self, target: Target, local_dir: str | None, uploads: bool) -> None:
        """Checked in the uploaded folder; one that is not there may be installed on the cluster."""
        try:
            self.check_locally(target, str(Path(local_dir or ".").resolve()))
        except UsageError as e:
            if "no module named" not in str(e):
                raise
            log.warning("%s is not here; submitting anyway, assuming the cluster has it", target.name)


class ModuleRunner(_Importable):
    flag = "-m"

    def shown_as(self, target: Target) -> str:
        return f"-m {target.name}"

    def main(self, target: Target, cwd: str) -> None:
        use_own_modules(fresh_sys_path(cwd))  # as `python -m`, which puts the working folder first
        sys.argv = [target.name, *target.args]
        runpy.run_module(target.name, run_name="__main__", alter_sys=True)


class EntrypointRunner(_Importable):
    flag = "--entrypoint"

    def main(self, target: Target, cwd: str) -> Any:
        use_own_modules(fresh_sys_path(cwd))
        module_name, func_name = split_ref(target.name)
        try:
            func = load_function(target.name)
        except AttributeError:
            func = None
        if not callable(func):
            raise TargetNotFound(f"{module_name} has no function {func_name} on node {socket.gethostname()}")
        sys.argv = [module_name, *target.args]
        return func()


RUNNERS: dict[TargetKind, TargetRunner] = {
    TargetKind.SCRIPT: ScriptRunner(),
    TargetKind.MODULE: ModuleRunner(),
    TargetKind.ENTRYPOINT: EntrypointRunner(),
}
