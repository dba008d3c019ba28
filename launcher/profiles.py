"""Env profiles: named sets of network and NCCL variables, kept as data under `env/`."""

from __future__ import annotations

from pathlib import Path

import yaml

from .errors import UsageError
from .rankenv import check_user_env

_PKG = Path(__file__).resolve().parent


def profile_dirs() -> list[Path]:
    """Where profiles live: `env/` of a checkout (editable install), or the copy inside a wheel."""
    return [d for d in (_PKG.parent / "env", _PKG / "_data" / "env") if d.is_dir()]


def available_profiles() -> list[str]:
    return sorted({p.stem for d in profile_dirs() for p in d.glob("*.yaml")})


def load_profile(name_or_path: str) -> dict[str, str]:
    """The variables of a profile given by name (`efa`) or by a path to a YAML file."""
    path = Path(name_or_path)
    if not (path.suffix in (".yaml", ".yml") and path.is_file()):
        found = [d / f"{name_or_path}.yaml" for d in profile_dirs() if (d / f"{name_or_path}.yaml").is_file()]
        if not found:
            raise UsageError(
                f"unknown env profile {name_or_path!r}; choose one of {', '.join(available_profiles())} "
                "or give a path to a YAML file with an `env:` mapping"
            )
        path = found[0]
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise UsageError(f"env profile {path} is not valid YAML: {e}".replace("\n", " ")) from None
    env = data.get("env") if isinstance(data, dict) else None
    if not isinstance(env, dict):
        raise UsageError(f"env profile {path} has no `env:` mapping of NAME: value")
    out = {str(k): "" if v is None else str(v) for k, v in env.items()}
    try:
        check_user_env(out, f"env profile {path.name}")
    except ValueError as e:
        raise UsageError(str(e)) from None
    return out
