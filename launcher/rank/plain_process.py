"""What a Ray worker process differs in from a process torchrun starts, made right once it runs.

A rank runs its program in the Ray worker process of its actor (rank/actor.py). Ray starts that
process with its own settings; a program must see the process torchrun would have given it. What
has to be there from the process's start is given to Ray: start-up variables when the actor is
created (driver/gang/actors.py), niceness when megaray starts the nodes
(driver/cluster/nodeenv.py); the rest is put right here, before the program runs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from ..core.blas import blas_threads
from .probes import inherited_env

# Ray overwrites it in every worker (its remote debugger); a program under torchrun gets the value
# its process started with, if any (PYTHONBREAKPOINT=0 turns breakpoint() off; unset, it is pdb).
RAY_OVERWRITES = ("PYTHONBREAKPOINT",)


def as_a_plain_process() -> None:
    """Signals and stdin, in the process's main thread (where rank/actor.py runs methods):

    - SIGINT: Ray's workers start with it blocked, and every process a rank starts inherits the
      mask: `KeyboardInterrupt` never came and a child sent SIGINT survived. Unblocked, with Python's
      own handler.
    - SIGTERM, SIGHUP, SIGQUIT: ignored where whoever started Ray had them ignored (a script's
      `megaray ... &` ignores SIGINT and SIGQUIT, and Ray's processes pass that on), so `kill -QUIT`
      of a rank did nothing. torchrun's agent handles these four, so its workers start with each at
      its default: so do the ranks (a handler Ray installed is left alone).
    - stdin: a Ray worker inherits the terminal of whoever started Ray, from a background process
      group, so `input()` stopped the rank (SIGTTIN) until the hang timeout. A rank reads end-of-file
      instead (`input()` raises EOFError), as under most cluster launchers.
    - PYTHONBREAKPOINT: back to what the process started with, so `breakpoint()` is pdb, not Ray's
      remote debugger (which warns about a missing debugpy and carries on).
    """
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for handled_by_torchrun in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        if signal.getsignal(handled_by_torchrun) == signal.SIG_IGN:
            signal.signal(handled_by_torchrun, signal.SIG_DFL)
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        os.dup2(null, 0)
    finally:
        os.close(null)
    at_start = inherited_env()  # the environment this process started with, before Ray changed it
    for key in RAY_OVERWRITES:
        if key in at_start:
            os.environ[key] = at_start[key]
        else:
            os.environ.pop(key, None)


def match_thread_pools() -> None:
    """Where numpy was imported before the rank's environment was set (a warm spare's or a warm
    pool's imports; Ray's serializers did so in every worker before they were registered on import,
    rank/serialization.py), its BLAS sized its thread pool from the worker's OMP_NUM_THREADS, not the
    rank's: `--env OMP_NUM_THREADS=8` gave numpy one thread. Each BLAS loaded by then gets the count
    it reads at load under the rank's environment, as under torchrun (core/blas.py). Nothing loaded,
    nothing done."""
    if "numpy" not in sys.modules:
        return
    had = set(sys.modules)
    from threadpoolctl import ThreadpoolController

    try:
        cpus = len(os.sched_getaffinity(0))
        for lib in ThreadpoolController().lib_controllers:
            want = blas_threads(lib.internal_api, os.environ, cpus) if lib.user_api == "blas" else None
            if want is not None and lib.num_threads != want:
                lib.set_num_threads(want)
    finally:
        for name in set(sys.modules) - had:  # megaray's use of it is not the program's import
            if name.split(".")[0] not in sys.stdlib_module_names:
                del sys.modules[name]


def fresh_sys_path(first: str) -> list[str]:
    """sys.path as a fresh `python script.py` starts with: `first` (the script's folder; the working
    folder for `-m`), then what the interpreter makes of PYTHONPATH, the standard library and
    site-packages (.pth files included), asked of this interpreter started afresh with this
    process's environment. A Ray worker's has Ray's own folders ahead of all that (its worker folder,
    its `thirdparty_files`, the working folder)."""
    ask = "import sys, json; print(json.dumps(sys.path[1:]))"
    try:
        done = subprocess.run(
            [sys.executable, "-c", ask], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL
        )
        rest = json.loads(done.stdout)
    except (OSError, subprocess.SubprocessError, ValueError):
        return [first, *sys.path]
    return [first, *rest]


def use_own_modules(path: list[str]) -> None:
    """Set sys.path to `path`, and forget the modules Ray loaded from its `thirdparty_files` (its own
    psutil and colorama) where `path` has the program's own: the program imports those, as under
    torchrun. Ray keeps the objects it holds."""
    import ray

    bundled = os.path.join(os.path.dirname(os.path.abspath(ray.__file__)), "thirdparty_files") + os.sep
    sys.path[:] = path
    shadowed = {
        name.partition(".")[0]
        for name, mod in list(sys.modules.items())
        if (getattr(mod, "__file__", None) or "").startswith(bundled)
    }
    for top in shadowed:
        if _has_own(top, bundled):  # else the program has none of its own: Ray's stays
            for name in [n for n in sys.modules if n == top or n.startswith(top + ".")]:
                del sys.modules[name]


def _has_own(top: str, bundled: str) -> bool:
    """Whether sys.path has a top-level module `top` other than Ray's bundled copy."""
    from importlib.machinery import PathFinder

    try:
        spec = PathFinder.find_spec(top, sys.path)
    except (ImportError, ValueError):
        return False
    return spec is not None and not (spec.origin or "").startswith(bundled)
