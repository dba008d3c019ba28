"""Recipes: data files under `recipes/` that name a Megatron-Bridge recipe function and its overrides,
or any of bridge's own recipe functions by name (`llama3_8b_pretrain_2gpu_h100_bf16_config`) or as
`module:function` (core/catalog.py finds them).

Precedence, stated once: overrides on the command line > the recipe file's `overrides` > what the
Megatron-Bridge recipe function returns (bridge's defaults). A recipe file:

    description: one line for `--recipe` listings
    function: megatron.bridge.recipes.gpt.vanilla_gpt:vanilla_gpt_pretrain_config
    hf_model: meta-llama/Meta-Llama-3-8B     # the HF config the function fetches (optional)
    overrides:                               # Hydra-style keys, applied in order
      model.num_layers: 2
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from . import catalog
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
    kind: str = ""  # pretrain, sft or peft ("" where neither the file nor the name says)


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
    if isinstance(value, str) and re.search(r"[,\[\]{}()=:'\"\s\\]", value):
        # a YAML string Hydra would read as a list or choke on ("100,0,0"): quoted, as on a command line
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return str(value)


def load_recipe(name_or_path: str) -> Recipe:
    """A recipe file (a name under recipes/ or a YAML path), else a bridge recipe function."""
    is_file = Path(name_or_path).suffix in (".yaml", ".yml") or any(
        (d / f"{name_or_path}.yaml").is_file() for d in recipe_dirs()
    )
    if not is_file:
        return bridge_recipe(name_or_path)
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
        kind=str(data.get("kind", "")),
    )


def bridge_recipe(name: str) -> Recipe:
    """One of Megatron-Bridge's recipe functions, by its name or as `module:function`."""
    if FUNCTION_REF.match(name):
        found = catalog.find(name.rsplit(":", 1)[1])
        return Recipe(
            name=name.rsplit(":", 1)[1],
            function=name,
            hf_model=found.hf_model if found else None,
            kind=found.kind if found else "",
        )
    found = catalog.find(name)
    if found is not None:
        return Recipe(name=found.name, function=found.ref, hf_model=found.hf_model, kind=found.kind)
    names = [r.name for r in catalog.bridge_recipes()]
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    where = (
        f"nor one of Megatron-Bridge's {len(names)} recipes; {hint}`megaray recipes` lists them all"
        if names
        else "and Megatron-Bridge is not installed here for its own (pip install megaray[megatron])"
    )
    raise UsageError(
        f"unknown recipe {name!r}: not a file under recipes/ ({', '.join(available_recipes())}) {where}"
    )


def check_overrides(overrides: list[str]) -> None:
    """Command-line overrides are Hydra `key=value` strings; anything else is a typo to report now."""
    for o in overrides:
        if not _OVERRIDE.match(o):
            raise UsageError(
                f"override {o!r} is not key=value (for example model.num_layers=2); "
                "with --recipe every trailing argument is an override"
            )
