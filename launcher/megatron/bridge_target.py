"""The Megatron target: build a recipe's config and call Megatron-Bridge `pretrain()` (or, for SFT
and PEFT recipes, `finetune()`) on this rank.

The config is built where it runs (each rank), and also in the driver for the preflight, from the
same function, so both see the same values. Also runnable under torchrun, for comparisons:

    torchrun --nproc-per-node 8 -m launcher.megatron.bridge_target --recipe llama3_8b train.train_iters=10
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from ..core.errors import UsageError
from ..core.recipes import Recipe, check_overrides, load_recipe
from ..core.refs import load_function
from . import compat
from .overrides import override_type_problem
from .steptimes import timed


@contextlib.contextmanager
def _hf_model_from(hf_model: str | None, hf_path: str | None) -> Iterator[None]:
    """Make the recipe function read `hf_path` where it asks for its hard-coded HF model id.

    Bridge 0.6 recipe functions take no arguments and call `AutoBridge.from_hf_pretrained(<id>)`.
    """
    if not (hf_model and hf_path):
        yield
        return
    from megatron.bridge import AutoBridge

    original = AutoBridge.__dict__["from_hf_pretrained"]

    def redirected(cls, path, *args, **kwargs):
        return original.__func__(cls, hf_path if str(path) == hf_model else path, *args, **kwargs)

    AutoBridge.from_hf_pretrained = classmethod(redirected)
    try:
        yield
    finally:
        AutoBridge.from_hf_pretrained = original


def recipe_function(recipe: Recipe):
    try:
        return load_function(recipe.function)
    except (ImportError, AttributeError) as e:
        raise UsageError(
            f"recipe {recipe.name}: cannot load {recipe.function} ({e}); check `function:` against the "
            "installed megatron-bridge"
        ) from None


def build_config(
    recipe: Recipe, overrides: list[str], hf_path: str | None = None, kernels: bool = True
) -> tuple[Any, list[str]]:
    """The recipe's ConfigContainer with the recipe file's overrides, then the command line's
    (`kernels` False: in a process that runs none, compat.py `import_bridge`).

    Returns the config and notes on what was adapted to this machine.
    """
    check_overrides(overrides)  # both refusals before bridge's import (12 CPU-s on 2 cores)
    if recipe.hf_model and not hf_path and (problem := hf_config_problem(recipe.hf_model)):
        raise UsageError(
            f"recipe {recipe.name} builds its model from {recipe.hf_model}'s config.json, which {problem}: "
            "pass --hf-path DIR (a folder with the model's config.json), or put it in the HF cache where "
            f"there is network (`huggingface-cli download {recipe.hf_model} config.json`) and set HF_HOME"
        )
    compat.import_bridge(kernels)
    function = recipe_function(recipe)
    try:
        with _hf_model_from(recipe.hf_model, hf_path):
            cfg = function()
    except Exception as e:
        reason = " ".join(str(e).split())[:300] or type(e).__name__
        raise UsageError(
            f"recipe {recipe.name}: {recipe.function} failed: {type(e).__name__}: {reason}"
        ) from None
    if hf_path and getattr(cfg.tokenizer, "tokenizer_model", None) == recipe.hf_model:
        cfg.tokenizer.tokenizer_model = hf_path
    cfg = apply_overrides(cfg, "recipe " + recipe.name, list(recipe.overrides))
    cfg = apply_overrides(cfg, "command line", overrides)
    return cfg, adapt(cfg)


def apply_overrides(cfg: Any, source: str, items: list[str]) -> Any:
    """Hydra-style `key=value` overrides, one at a time, so an error names the key that caused it."""
    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides

    for item in items:
        key = item.split("=", 1)[0]
        try:
            cfg = process_config_with_overrides(cfg, cli_overrides=[item])
        except Exception as e:
            reason = " ".join(str(e).split())[:300]
            raise UsageError(
                f"override {item!r} from the {source}: {reason}; check the key {key!r}"
            ) from None
        if problem := override_type_problem(cfg, key.lstrip("+~")):
            raise UsageError(f"override {item!r} from the {source}: {problem}")
    return cfg


def adapt(cfg: Any) -> list[str]:
    """What this machine needs changed (no TransformerEngine: the local layer spec, no fused kernels),
    as notes; applying it again changes nothing."""
    why = (
        "the recipe asks for the local implementation"
        if compat.te_installed()
        else "no TransformerEngine here"
    )
    changed = compat.adapt_model_without_te(cfg.model) + compat.adapt_optimizer_without_te(cfg.optimizer)
    return [f"{why}: {c}" for c in changed]


# A config built on this rank before its program's go (`prebuild`), while the driver waits for the
# preflight's verdict or, in a warm spare, while the attempt it would replace trains: the program
# takes it instead of building it again (2.0-2.5 s of bridge's recipe and overrides on an H100 node).
_prebuilt: dict[tuple[str, str | None], tuple[Any, list[str], tuple[str, ...]]] = {}


def prebuild(recipe: Recipe, overrides: list[str], hf_path: str | None = None) -> bool:
    """Build the config ahead; a failure is left to the program, which reports it. Whether it built."""
    try:
        cfg, notes = build_config(recipe, overrides, hf_path)
    except Exception:
        return False
    _prebuilt[(recipe.name, hf_path)] = (cfg, notes, tuple(overrides))
    return True


def copy_prebuilt(recipe: Recipe, overrides: list[str], hf_path: str | None) -> tuple[Any, list[str]] | None:
    """A copy of the config built ahead for exactly these overrides (rank 0 answering for the
    preflight, which changes what it checks), leaving it for the program."""
    import copy

    built = _prebuilt.get((recipe.name, hf_path))
    if built is None or built[2] != tuple(overrides):
        return None
    return copy.deepcopy(built[0]), list(built[1])


def take_prebuilt(recipe: Recipe, overrides: list[str], hf_path: str | None) -> tuple[Any, list[str]] | None:
    """The config built ahead for these overrides, or for the first of them, with the others applied
    now (the go adds a collective timeout; a relaunch, `checkpoint.load`); taken once."""
    built = _prebuilt.pop((recipe.name, hf_path), None)
    if built is None:
        return None
    cfg, notes, given = built
    if tuple(overrides[: len(given)]) != given:
        return None
    rest = list(overrides[len(given) :])
    if not rest:
        return cfg, notes
    cfg = apply_overrides(cfg, "command line", rest)
    return cfg, notes + [n for n in adapt(cfg) if n not in notes]


def te_adapted(notes: list[str]) -> bool:
    """Whether build_config switched a recipe that asks for TransformerEngine to the local spec,
    because this machine has no TE (the ranks are expected to have it)."""
    return any(n.startswith("no TransformerEngine here: transformer_impl") for n in notes)


def hf_config_problem(repo: str) -> str | None:
    """Why `repo`'s config.json cannot be had here, or None: bridge's recipes fetch it, and offline
    they retry for minutes before a long traceback."""
    from huggingface_hub import constants

    folder = Path(constants.HF_HUB_CACHE) / f"models--{repo.replace('/', '--')}" / "snapshots"
    if any(folder.glob("*/config.json")):
        return None
    if constants.HF_HUB_OFFLINE:
        return f"is not in the HF cache ({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE is set"
    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        with socket.create_connection((host, 443), timeout=3):
            return None
    except OSError as e:
        cache = constants.HF_HUB_CACHE
        return f"is not in the HF cache ({cache}) and {host} cannot be reached ({e.strerror or e})"


def is_finetune(recipe: Recipe, cfg: Any) -> bool:
    """SFT and PEFT recipes run bridge's finetune(), which starts from pretrained weights."""
    return (
        recipe.kind in ("sft", "peft")
        or getattr(cfg, "peft", None) is not None
        or type(cfg.dataset).__name__.startswith("Finetuning")
    )


def has_checkpoint(path: str | None) -> bool:
    """Whether `path` holds a Megatron checkpoint to resume from (bridge's tracker file, or iter_*)."""
    if not path or not os.path.isdir(path):
        return False
    return os.path.isfile(os.path.join(path, "latest_checkpointed_iteration.txt")) or any(
        name.startswith("iter_") for name in os.listdir(path)
    )


def finetune_problem(recipe: Recipe, cfg: Any) -> str | None:
    """Finetuning without pretrained weights: bridge asserts once every rank has started when no
    checkpoint is named, and, when `checkpoint.load` names an empty folder (the recipes' default),
    trains from random weights without a word."""
    ckpt = cfg.checkpoint
    if not is_finetune(recipe, cfg) or ckpt.pretrained_checkpoint or has_checkpoint(ckpt.load):
        return None
    hf = recipe.hf_model or "ORG/MODEL"
    return (
        f"recipe {recipe.name} finetunes pretrained weights: pass checkpoint.pretrained_checkpoint=DIR, a "
        f'Megatron checkpoint (from HF weights: python -c "from megatron.bridge import AutoBridge; '
        f"AutoBridge.import_ckpt('{hf}', 'DIR')\")"
    )


def train_recipe(recipe: Recipe, overrides: list[str], hf_path: str | None = None) -> None:
    """What each rank runs: Megatron-Bridge `pretrain(config=cfg, forward_step_func=forward_step)`,
    or `finetune(...)` for SFT and PEFT recipes, as bridge's own example scripts call them."""
    cfg, notes = take_prebuilt(recipe, overrides, hf_path) or build_config(recipe, overrides, hf_path)
    for note in notes:
        print(f"megaray: {note}", flush=True)
    if problem := finetune_problem(recipe, cfg):
        raise UsageError(problem)
    compat.skip_compile_helpers_if_prebuilt()
    from megatron.bridge.training.gpt_step import forward_step

    if is_finetune(recipe, cfg):
        from megatron.bridge.training.finetune import finetune as entry
    else:
        from megatron.bridge.training.pretrain import pretrain as entry
    entry(config=cfg, forward_step_func=timed(forward_step))  # timed: straggler detection (steptimes.py)
    report_peak_memory()


def report_peak_memory() -> None:
    """One line with this rank's peak GPU memory, the figure a memory estimate is checked against
    (Megatron logs its own only after the first iterations)."""
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return
    gib = 2**30
    print(
        f"megaray: rank {os.environ.get('RANK', '0')} peak GPU memory: "
        f"{torch.cuda.max_memory_allocated() / gib:.2f} GiB allocated, "
        f"{torch.cuda.max_memory_reserved() / gib:.2f} GiB reserved",
        flush=True,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m launcher.megatron.bridge_target")
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--hf-path")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    train_recipe(load_recipe(args.recipe), args.overrides, args.hf_path)


if __name__ == "__main__":
    main()
