"""Megatron-Bridge's own recipes, found by reading its source rather than importing it.

Bridge 0.6 ships about 300 recipe functions (`llama3_8b_pretrain_2gpu_h100_bf16_config`, SFT and
PEFT ones too). Importing `megatron.bridge.recipes` takes tens of seconds and pulls in diffusers and
TransformerEngine, and building each config fetches an HF config.json; listing them must take a
moment, so each recipe module is parsed (`ast`) and what a listing shows is read from the function's
name, its docstring and its literal assignments (`cfg.model.tensor_model_parallel_size = 2`).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "megatron.bridge.recipes"
_KIND = re.compile(r"_(pretrain|sft|peft|finetune)(?:_|$)")
_GPUS = re.compile(r"_(\d+)gpu(?:s)?_")
_HARDWARE = re.compile(r"_(h100|h200|b200|b300|gb200|gb300|a100)(?:_|$)")
_PARALLEL = {
    "tensor_model_parallel_size": "TP",
    "pipeline_model_parallel_size": "PP",
    "context_parallel_size": "CP",
    "expert_model_parallel_size": "EP",
}


@dataclass(frozen=True)
class BridgeRecipe:
    """One recipe function of Megatron-Bridge, as its source states it."""

    name: str  # the function's name: what `--recipe` takes
    module: str  # dotted module that defines it
    family: str  # the folder under megatron/bridge/recipes (llama, qwen, deepseek, ...)
    kind: str  # pretrain, sft, peft (finetune counts as sft), or "" where the name does not say
    gpus: int | None  # the GPU count the recipe is built for, where its name says
    hardware: str  # h100, b200, ... where its name says
    parallel: tuple[tuple[str, int], ...]  # ("TP", 2), ... set literally in the function
    hf_model: str | None  # the HF model whose config.json the function fetches

    @property
    def ref(self) -> str:
        return f"{self.module}:{self.name}"

    @property
    def layout(self) -> str:
        return " ".join(f"{k}{v}" for k, v in self.parallel) or "-"


def bridge_recipes_dir() -> Path | None:
    """The installed bridge's recipes folder, found without importing bridge."""
    try:
        spec = importlib.util.find_spec("megatron.bridge")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))) / "recipes"
    return folder if folder.is_dir() else None


def _strings(scope: ast.AST) -> dict[str, str]:
    """Names bound to a string literal in `scope` (`hf_path = "org/model"`)."""
    return {
        t.id: node.value.value
        for node in ast.walk(scope)
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
        for t in node.targets
        if isinstance(t, ast.Name)
    }


def _direct_hf_model(fn: ast.FunctionDef, names: dict[str, str]) -> str | None:
    """The first literal (or literal-bound name) passed to `from_hf_pretrained` or as `hf_path=`."""
    local = {**names, **_strings(fn)}
    for node in ast.walk(fn):
        if not isinstance(node, ast.Call):
            continue
        args = list(node.args[:1]) if getattr(node.func, "attr", "") == "from_hf_pretrained" else []
        args += [k.value for k in node.keywords if k.arg in ("hf_path", "hf_model_id", "hf_model_path")]
        for arg in args:
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and "/" in arg.value:
                return arg.value
            if isinstance(arg, ast.Name) and "/" in local.get(arg.id, ""):
                return local[arg.id]
    return None


def _calls(fn: ast.FunctionDef) -> list[str]:
    return [n.func.id for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]


def _hf_models(tree: ast.Module) -> dict[str, str | None]:
    """Each function's HF model: its own literal, one it passes to a helper of the module that fetches
    a config (`_common("org/model")`), or that of a function of the module it calls."""
    module_names = {
        k: v for node in tree.body if isinstance(node, ast.Assign) for k, v in _strings(node).items()
    }
    fns = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}
    direct = {name: _direct_hf_model(f, module_names) for name, f in fns.items()}
    fetches = {
        name
        for name, f in fns.items()
        if any(
            isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "from_hf_pretrained"
            for n in ast.walk(f)
        )
    }

    def passed(fn: ast.FunctionDef) -> str | None:
        local = {**module_names, **_strings(fn)}
        for n in ast.walk(fn):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in fetches:
                for arg in [*n.args, *(k.value for k in n.keywords)]:
                    value = arg.value if isinstance(arg, ast.Constant) else local.get(getattr(arg, "id", ""))
                    if isinstance(value, str) and "/" in value:
                        return value
        return None

    def resolve(name: str, seen: frozenset[str]) -> str | None:
        if found := direct.get(name) or passed(fns[name]):
            return found
        for callee in _calls(fns[name]):
            if callee in fns and callee not in seen and (found := resolve(callee, seen | {callee})):
                return found
        return None

    return {name: resolve(name, frozenset({name})) for name in fns}


def _parallel(fn: ast.FunctionDef) -> tuple[tuple[str, int], ...]:
    found: dict[str, int] = {}
    for node in ast.walk(fn):
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)):
            continue
        for t in node.targets:
            short = _PARALLEL.get(getattr(t, "attr", ""))
            if short and isinstance(node.value.value, int) and not isinstance(node.value.value, bool):
                found[short] = node.value.value
    return tuple((k, found[k]) for k in _PARALLEL.values() if k in found)


def scan_module(path: Path, module: str, family: str) -> list[BridgeRecipe]:
    """The recipe functions `path` defines: public, top-level, named `*_config`."""
    try:
        tree = ast.parse(path.read_text(), filename=str(path))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return []
    hf = _hf_models(tree)
    out = []
    for fn in tree.body:
        if not isinstance(fn, ast.FunctionDef) or fn.name.startswith("_") or not fn.name.endswith("_config"):
            continue
        kind = m.group(1) if (m := _KIND.search(fn.name)) else ""
        gpus = int(m.group(1)) if (m := _GPUS.search(fn.name)) else None
        hardware = m.group(1) if (m := _HARDWARE.search(fn.name)) else ""
        out.append(
            BridgeRecipe(
                name=fn.name,
                module=module,
                family=family,
                kind="sft" if kind == "finetune" else kind,
                gpus=gpus,
                hardware=hardware,
                parallel=_parallel(fn),
                hf_model=hf[fn.name],
            )
        )
    return out


def scan(root: Path) -> list[BridgeRecipe]:
    """Every recipe function under `root` (bridge's recipes folder), each once, sorted by family and
    name; a function re-exported by several modules is listed where it is defined."""
    seen: dict[str, BridgeRecipe] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.name == "__init__.py" or rel.parts[0] in ("utils", "__pycache__"):
            continue
        module = ".".join((PACKAGE, *rel.with_suffix("").parts))
        for r in scan_module(path, module, rel.parts[0] if len(rel.parts) > 1 else rel.stem):
            seen.setdefault(r.name, r)
    return sorted(seen.values(), key=lambda r: (r.family, r.name))


@functools.cache
def bridge_recipes() -> tuple[BridgeRecipe, ...]:
    """The installed bridge's recipes; none without bridge."""
    root = bridge_recipes_dir()
    return tuple(scan(root)) if root else ()


def find(name: str) -> BridgeRecipe | None:
    return next((r for r in bridge_recipes() if r.name == name), None)
