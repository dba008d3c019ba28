"""megaray: run torchrun-style and Megatron training on a Ray cluster, one actor per rank.

From Python, the same path as the command line:

    from launcher import launch, spec_from_args
    result = launch(spec_from_args(["--nodes", "2", "--gpus-per-node", "8", "--entrypoint", "train:main"]))
    result.returns  # what each rank's function returned, by rank

`launch`, `LaunchResult`, `RankGroup` and `RankGang` import Ray on first use, so that importing the
package stays light and the CLI can configure Ray's logging before Ray is imported. `report()` sends
progress to the driver from a rank, `checkpointing()` wraps a checkpoint save (no-ops outside a
launch).

The package is grouped by where code runs: `core/` (pure decisions, no Ray or torch), `driver/`
(the launch and everything that talks to Ray), `rank/` (inside each rank's process), `megatron/`
(the Megatron-Bridge target, its preflight, the CPU dry run), `cli/` (the command lines).
"""

from .core.errors import (
    ClusterError,
    Interrupted,
    MegarayError,
    RankFailedError,
    RankFailure,
    ResourceError,
    UsageError,
)
from .core.launch_args import spec_from_args
from .core.recipes import Recipe, load_recipe
from .core.spec import LaunchSpec
from .core.target import Target, TargetKind
from .rank.capture import checkpointing, report

__all__ = [
    "ClusterError",
    "Interrupted",
    "LaunchResult",
    "LaunchSpec",
    "MegarayError",
    "RankFailedError",
    "RankFailure",
    "RankGang",
    "RankGroup",
    "RankInfo",
    "Recipe",
    "ResourceError",
    "Target",
    "TargetKind",
    "UsageError",
    "checkpointing",
    "launch",
    "load_recipe",
    "report",
    "spec_from_args",
]

_LAZY = {
    "launch": "driver.lifecycle.launch",
    "LaunchResult": "core.outcome",
    "RankInfo": "core.topology",
    "RankGang": "driver.gang.gang",
    "RankGroup": "driver.gang.group",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'launcher' has no attribute {name!r}")
