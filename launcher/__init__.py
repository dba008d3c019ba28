"""megaray: run torchrun-style and Megatron training on a Ray cluster, one actor per rank.

From Python, the same path as the command line:

    from launcher import launch, spec_from_args
    result = launch(spec_from_args(["--nodes", "2", "--gpus-per-node", "8", "--entrypoint", "train:main"]))
    result.returns  # what each rank's function returned, by rank

`launch` and `LaunchResult` import Ray on first use, so that importing the package stays light and
the CLI can configure Ray's logging before Ray is imported.
"""

from .errors import (
    ClusterError,
    Interrupted,
    MegarayError,
    RankFailedError,
    RankFailure,
    ResourceError,
    UsageError,
)
from .recipes import Recipe, load_recipe
from .spec import LaunchSpec, Target, spec_from_args

__all__ = [
    "ClusterError",
    "Interrupted",
    "LaunchResult",
    "LaunchSpec",
    "MegarayError",
    "RankFailedError",
    "RankFailure",
    "RankGroup",
    "RankInfo",
    "Recipe",
    "ResourceError",
    "Target",
    "UsageError",
    "launch",
    "load_recipe",
    "spec_from_args",
]

_LAZY = {"launch": "driver", "LaunchResult": "driver", "RankInfo": "driver", "RankGroup": "group"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'launcher' has no attribute {name!r}")
