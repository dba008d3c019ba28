"""How many threads a BLAS library takes when it loads, read from the environment as the library
itself reads it. A rank's process loads numpy (and its BLAS) before the rank's environment is set
(rank/plain_process.py says why); it is then given the count it would have read at its start."""

from __future__ import annotations

from collections.abc import Mapping

# The variables each BLAS reads at load, first found wins (threadpoolctl's `internal_api` names);
# with none set, it takes every CPU the process may run on.
BLAS_THREAD_VARS: dict[str, tuple[str, ...]] = {
    "openblas": ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS"),
    "mkl": ("MKL_NUM_THREADS", "OMP_NUM_THREADS"),
    "blis": ("BLIS_NUM_THREADS", "OMP_NUM_THREADS"),
}


def blas_threads(internal_api: str, environ: Mapping[str, str], cpus: int) -> int | None:
    """The thread count `internal_api` would have started with under `environ`; None for a library
    not known here (left as it is)."""
    names = BLAS_THREAD_VARS.get(internal_api)
    if names is None:
        return None
    for name in names:
        head = environ.get(name, "").split(",")[0].strip()  # OpenMP's list form ("4,2"): the first level's
        if head.isdigit() and int(head) > 0:
            return int(head)
    return cpus
