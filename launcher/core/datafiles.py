"""Data shipped with megaray (env profiles under `env/`, recipes under `recipes/`), found by name.

They sit at the top of a checkout (an editable install reads them there) and inside the package
of a wheel (`launcher/_data/<folder>`, see pyproject.toml). A path to a YAML file works too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from .errors import UsageError

_PKG = Path(__file__).resolve().parent.parent  # the launcher package


def data_dirs(folder: str) -> list[Path]:
    return [d for d in (_PKG.parent / folder, _PKG / "_data" / folder) if d.is_dir()]


def available(folder: str) -> list[str]:
    return sorted({p.stem for d in data_dirs(folder) for p in d.glob("*.yaml")})


def load_yaml(folder: str, name_or_path: str, what: str) -> tuple[Path, Any]:
    """The file for `name_or_path` and its parsed YAML; unknown names list the known ones."""
    path = Path(name_or_path)
    if not (path.suffix in (".yaml", ".yml") and path.is_file()):
        found = [
            d / f"{name_or_path}.yaml" for d in data_dirs(folder) if (d / f"{name_or_path}.yaml").is_file()
        ]
        if not found and path.suffix in (".yaml", ".yml"):  # a path, not a name: say so
            raise UsageError(
                f"{what} file {name_or_path} not found (looked in {Path.cwd()}); give the path of a YAML "
                f"file, or one of {', '.join(available(folder))}"
            )
        if not found:
            raise UsageError(
                f"unknown {what} {name_or_path!r}; choose one of {', '.join(available(folder))} "
                "or give a path to a YAML file"
            )
        path = found[0]
    try:
        return path, yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise UsageError(f"{what} {path} is not valid YAML: {e}".replace("\n", " ")) from None
