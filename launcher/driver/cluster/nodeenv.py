"""The environment of a node's Ray processes: what a node's `ray start` would have, not the
variables of whoever launched (core/rankenv.py forwards the ones ranks need, the same way locally
and on a cluster)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping

from ...core.rankenv import NODE_DEFAULTS, is_startup_var

# What a node's `ray start` would have in its environment: the login basics and the Python it runs,
# Ray's own settings and machine-level fixes; not the variables of whoever launched (rankenv.py
# forwards the ones ranks need, the same way locally and on a cluster).
NODE_ENV = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TEMP", "TMP", "HOSTNAME",
    "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "CONDA_PREFIX", "CONDA_DEFAULT_ENV", "LD_LIBRARY_PATH",
    "LD_PRELOAD", "CUDA_HOME", "CUDA_VISIBLE_DEVICES",
})  # fmt: skip
NODE_ENV_PREFIXES = ("LC_", "RAY_", "PYENV", "OPENBLAS_")


def node_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment a node megaray starts runs with: what `environ` holds of NODE_ENV, and its
    start-up variables (PYTHONHASHSEED, PYTHONUNBUFFERED, MALLOC_*: what a `ray start` from this shell
    would have, so that its ranks start with them as torchrun's do, core/shellenv.py), over the node
    defaults (core/rankenv.py NODE_DEFAULTS: ranks at niceness 0, a node stopped without a drain; the
    driver's own value wins)."""
    keep = {
        k: v
        for k, v in environ.items()
        if k in NODE_ENV or k.startswith(NODE_ENV_PREFIXES) or is_startup_var(k)
    }
    return {**NODE_DEFAULTS, **keep}


@contextlib.contextmanager
def node_environment() -> Iterator[None]:
    """Start local Ray processes with a node's environment, not the driver's (restored after)."""
    saved = dict(os.environ)
    keep = node_env(saved)
    os.environ.clear()
    os.environ.update(keep)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
