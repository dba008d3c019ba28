"""megaray: run torchrun-style and Megatron training on a Ray cluster, one actor per rank."""

from .errors import ClusterError, Interrupted, MegarayError, RankFailedError, ResourceError, UsageError
from .spec import LaunchSpec, Target, spec_from_args

__all__ = [
    "ClusterError",
    "Interrupted",
    "LaunchSpec",
    "MegarayError",
    "RankFailedError",
    "ResourceError",
    "Target",
    "UsageError",
    "spec_from_args",
]
