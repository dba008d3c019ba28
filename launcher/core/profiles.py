"""Env profiles: named sets of network and NCCL variables, kept as data under `env/`."""

from __future__ import annotations

from .datafiles import available, load_yaml
from .errors import UsageError
from .rankenv import check_user_env


def available_profiles() -> list[str]:
    return available("env")


def load_profile(name_or_path: str) -> dict[str, str]:
    """The variables of a profile given by name (`efa`) or by a path to a YAML file."""
    path, data = load_yaml("env", name_or_path, "env profile")
    env = data.get("env") if isinstance(data, dict) else None
    if not isinstance(env, dict):
        raise UsageError(f"env profile {path} has no `env:` mapping of NAME: value")
    out = {str(k): "" if v is None else str(v) for k, v in env.items()}
    try:
        check_user_env(out, f"env profile {path.name}")
    except ValueError as e:
        raise UsageError(str(e)) from None
    return out
