"""What every rank runs, and the checks the driver can make on it before anything is placed.

A target is a script (`python script.py args`, as torchrun runs it), a module (`python -m`), a
`pkg.module:function` entrypoint, a Megatron-Bridge recipe (its `args` are the overrides), the
built-in dry run, or a rank group's functions (called from the driver's process).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import sys
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from .dataset_paths import missing_data
from .errors import UsageError
from .recipes import Recipe
from .refs import FUNCTION_REF, split_ref

_MODULE = re.compile(r"^[A-Za-z_][\w.]*\Z")


class TargetKind(StrEnum):
    SCRIPT = "script"
    MODULE = "module"
    ENTRYPOINT = "entrypoint"
    MEGATRON = "megatron"
    DRYRUN = "dryrun"
    GROUP = "group"


@dataclass(frozen=True)
class Target:
    kind: TargetKind
    name: str
    args: tuple[str, ...] = ()
    recipe: Recipe | None = None
    hf_path: str | None = None

    def __post_init__(self):
        try:
            object.__setattr__(self, "kind", TargetKind(self.kind))
        except ValueError:
            raise ValueError(f"unknown target kind {self.kind!r}") from None
        if self.kind is TargetKind.ENTRYPOINT and not FUNCTION_REF.match(self.name):
            raise ValueError(f"--entrypoint {self.name!r} is not of the form pkg.module:function")
        if self.kind is TargetKind.MODULE and not _MODULE.match(self.name):
            raise ValueError(f"-m {self.name!r} is not a module name such as pkg.train")


DRY_RUN_TARGET = Target(TargetKind.DRYRUN, "launcher.megatron.dryrun:check_and_train")
GROUP_TARGET = Target(TargetKind.GROUP, "rank group")


def on_or_off(value: str) -> bool:
    """A yes/no dry-run option: 1/true/on or 0/false/off, as Megatron-Bridge's overrides take booleans."""
    word = value.strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off"):
        return False
    raise ValueError(value)


# exit_signal_handler: as Megatron-Bridge's `train.exit_signal_handler`, SIGTERM to any rank stops the
# training at the next step on every rank, with a checkpoint where `save` is given, and exit 0
DRY_RUN_OPTIONS = {
    "steps": int, "save": str, "save_every": int, "data": str, "tp": int, "pp": int, "global_batch": int,
    "exit_signal_handler": on_or_off,
}  # fmt: skip


def parse_dry_run_options(args: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """`--dry-run steps=40 save=DIR save_every=5 data=PREFIX tp=1 pp=2 global_batch=16
    exit_signal_handler=true`: the tiny trainer's length (steps=0: no training, the rendezvous check
    alone, Megatron never imported), checkpoints, a Megatron indexed dataset (PREFIX.bin/.idx) to train
    on instead of counting sequences, its layout, the sequences a step takes over all its DP ranks,
    and whether SIGTERM stops it gracefully (Megatron-Bridge's `train.exit_signal_handler`)."""
    options: dict[str, Any] = {}
    for item in args:
        key, sep, value = item.partition("=")
        if not sep or key not in DRY_RUN_OPTIONS:
            raise ValueError(
                f"--dry-run takes {', '.join(k + '=' for k in DRY_RUN_OPTIONS)} options, got {item!r}"
            )
        try:
            options[key] = DRY_RUN_OPTIONS[key](value)
        except ValueError:
            kind = "true or false" if DRY_RUN_OPTIONS[key] is on_or_off else DRY_RUN_OPTIONS[key].__name__
            raise ValueError(f"--dry-run {item!r}: {key} must be {kind}") from None
        least = 0 if key == "steps" else 1  # steps=0: the rendezvous check alone, no training
        if DRY_RUN_OPTIONS[key] is int and options[key] < least:
            raise ValueError(f"--dry-run {item!r}: {key} must be at least {least}")
    return options


def dry_run_trains(args: list[str] | tuple[str, ...]) -> bool:
    """Whether the dry run trains after its check: unless `steps=0` (where megatron-core is there)."""
    return parse_dry_run_options(args).get("steps") != 0


def check_dry_run_data(args: tuple[str, ...], cwd: str) -> None:
    """`--dry-run data=PREFIX`: the Megatron indexed dataset is there (relative to `cwd`)."""
    prefix = parse_dry_run_options(args).get("data")
    if prefix and missing_data([os.path.join(cwd, prefix)]):
        raise UsageError(
            f"--dry-run data={prefix}: no {prefix}.bin and .idx (looked in {cwd}); give the prefix of a "
            "Megatron indexed dataset, which `python examples/data/prepare.py` makes from a text file"
        )


def check_script(name: str, cwd: str) -> None:
    """A script is a Python file, found from `cwd`."""
    path = os.path.join(cwd, name)
    if os.path.isdir(path):
        raise UsageError(
            f"script {name} is a folder, not a Python file; give the file to run (or a package's "
            "module with -m)"
        )
    if not os.path.isfile(path):
        raise UsageError(f"script {name} not found (looked in {cwd}); give the path of a Python file")


def check_importable(ref: str, cwd: str, flag: str) -> None:
    """A module (`-m`) or the module of a `pkg.module:function` (`--entrypoint`) can be found from
    `cwd` or the installed packages, and an entrypoint's module defines its function: located and
    parsed, not imported (importing user code in the driver could import torch or start work there)."""
    module_name, func_name = split_ref(ref)
    sys.path.insert(0, cwd)
    try:
        found = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):
        found = None
    finally:
        sys.path.remove(cwd)
    if found is None:
        raise UsageError(
            f"{flag} {ref}: no module named {module_name} in {cwd} or the installed packages; "
            "check the spelling or install the package"
        )
    if func_name and found.origin and found.origin.endswith(".py"):
        names = _top_level_names(found.origin)
        if names is not None and func_name not in names:
            raise UsageError(
                f"{flag} {ref}: {module_name} ({found.origin}) defines no {func_name}; "
                "name a function defined at the top level of that module"
            )


def _top_level_names(path: str) -> set[str] | None:
    """Names bound at module level, or None when they cannot be known statically (star imports)."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return None
    names: set[str] = set()
    for node in ast.walk(tree):  # nested names count too: a superset never rejects a real function
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    return None
                names.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    if "__getattr__" in names:  # a module-level __getattr__ can provide any name
        return None
    return names
