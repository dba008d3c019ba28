"""Plain programs on a rank, run as torchrun runs them: a script or a module as `__main__` with
`sys.argv` set and the program's own folder first on `sys.path`, or a `pkg.module:function`."""

from __future__ import annotations

import os
import runpy
import socket
import sys
from typing import Any

from ..core.refs import load_function, split_ref
from ..core.runner import TargetRunner
from ..core.target import Target, TargetKind
from .plain_process import fresh_sys_path, use_own_modules


class TargetNotFound(Exception):
    pass


class ScriptRunner(TargetRunner):
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


class ModuleRunner(TargetRunner):
    def main(self, target: Target, cwd: str) -> None:
        use_own_modules(fresh_sys_path(cwd))  # as `python -m`, which puts the working folder first
        sys.argv = [target.name, *target.args]
        runpy.run_module(target.name, run_name="__main__", alter_sys=True)


class EntrypointRunner(TargetRunner):
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
