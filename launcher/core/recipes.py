"""Recipes: data files under `recipes/` that name a Megatron-Bridge recipe function and its overrides.

Precedence, stated once: overrides on the command line > the recipe file's `overrides` > what the
Megatron-Bridge recipe function returns (bridge's defaults). A recipe file:

    description: one line for `--recipe` listings
    function: megatron.bridge.recipes.gpt.vanilla_gpt:vanilla_gpt_pretrain_config
    hf_model: meta-llama/Meta-Llama-3-8B     # the HF config the function fetches (optional)
    overrides:                               # Hydra-style keys, applied in order
      model.num_layers: 2
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from .datafiles import available, data_dirs, load_yaml
from .errors import UsageError
from .refs import FUNCTION_REF

_OVERRIDE = re.compile(r"^[+~]{0,2}[A-Za-z_][\w.]*=")


@dataclass(frozen=True)
class Recipe:
    name: str
    function: str  # "pkg.module:function" returning a ConfigContainer
    overrides: tuple[str, ...] = ()  # "key=value", the recipe file's own
    hf_model: str | None = None
    description: str = ""


def recipe_dirs() -> list[Path]:
    return data_dirs("recipes")


def available_recipes() -> list[str]:
    return available("recipes")


def yaml_value(value: object) -> str:
    """A YAML scalar as Hydra reads it on a command line (null, true, 3e-4, lists)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, dict)):
        return yaml.safe_dump(value, default_flow_style=True).strip()
    return str(value)


def load_recipe(name_or_path: str) -> Recipe:
    path, data = load_yaml("recipes", name_or_path, "recipe")
    function = data.get("function") if isinstance(data, dict) else None
    if not isinstance(function, str) or not FUNCTION_REF.match(function):
        raise UsageError(
            f"recipe {path} needs `function: pkg.module:function` naming a Megatron-Bridge recipe"
        )
    overrides = data.get("overrides") or {}
    if not isinstance(overrides, dict):
        raise UsageError(f"recipe {path}: `overrides` must be a mapping of dotted keys to values")
    return Recipe(
        name=path.stem,
        function=function,
        overrides=tuple(f"{k}={yaml_value(v)}" for k, v in overrides.items()),
        hf_model=data.get("hf_model"),
        description=str(data.get("description", "")),
    )


def check_overrides(overrides: list[str]) -> None:
    """Command-line overrides are Hydra `key=value` strings; anything else is a typo to report now."""
    for o in overrides:
        if not _OVERRIDE.match(o):
            raise UsageError(
                f"override {o!r} is not key=value (for example model.num_layers=2); "
                "with --recipe every trailing argument is an override"
            )
