"""`megaray recipes [NAME]`: what `--recipe` takes, and one recipe resolved.

The listing reads bridge's source (core/catalog.py) and is there in a moment; `megaray recipes NAME`
builds that one config, as the preflight does (bridge's import takes a while), and shows what the
launch would run: layout, model size, batch, the HF model it needs, the memory estimate.
"""

from __future__ import annotations

import argparse
import logging

from ..core.args import ArgumentParser
from ..core.catalog import bridge_recipes
from ..core.recipes import available_recipes, load_recipe
from ..core.topology import format_table

log = logging.getLogger("megaray")


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="megaray recipes", description=__doc__.splitlines()[0])
    p.add_argument("name", nargs="?", help="show this recipe resolved (a file under recipes/ or bridge's)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, as after --recipe")
    p.add_argument("--family", help="list only this model family (llama, qwen, deepseek, ...)")
    p.add_argument("--kind", choices=("pretrain", "sft", "peft"), help="list only this kind")
    p.add_argument("--hf-path", help="HF model id or local folder to read the model config from")
    p.add_argument("--nodes", type=int, default=1, help="for the memory estimate (default 1)")
    p.add_argument("--gpus-per-node", type=int, help="for the memory estimate (default: the recipe's GPUs)")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.name:
        from ..megatron.preflight import quiet_megatron

        # importing bridge takes 10-20 s: said first, so that a silent terminal is not taken for a hang
        log.info("building recipe %s with Megatron-Bridge (importing it takes seconds)...", args.name)
        with quiet_megatron():
            return show(args)
    rows = [["name", "family", "kind", "gpus", "layout", "hf model"]]
    if args.family is None and args.kind is None:  # a file's family and kind are its function's
        files = [load_recipe(name) for name in available_recipes()]
        rows += [[r.name, "(file)", r.kind or "-", "-", "-", r.hf_model or "-"] for r in files]
    listed = [
        r
        for r in bridge_recipes()
        if (args.family is None or r.family == args.family) and (args.kind is None or r.kind == args.kind)
    ]
    rows += [
        [r.name, r.family, r.kind or "-", str(r.gpus or "-"), r.layout, r.hf_model or "-"] for r in listed
    ]
    print(format_table(rows))
    if not bridge_recipes():
        log.warning(
            "Megatron-Bridge is not installed here: only the recipe files are listed "
            "(pip install megaray[megatron])"
        )
    else:
        print(
            f"\n{len(listed)} of Megatron-Bridge's {len(bridge_recipes())} recipes; "
            "`megaray recipes NAME` shows one"
        )
    return 0


def describe_data(dataset) -> str:
    for attr in ("blend", "dataset_root", "dataset_name"):
        if getattr(dataset, attr, None):
            return f"{attr} {str(getattr(dataset, attr))[:100]}"
    return "mock" if "Mock" in type(dataset).__name__ or hasattr(dataset, "blend") else type(dataset).__name__


def show(args: argparse.Namespace) -> int:
    from ..core.catalog import find
    from ..megatron.bridge_target import build_config, te_adapted
    from ..megatron.memory import estimate

    recipe = load_recipe(args.name)
    cfg, notes = build_config(recipe, list(args.overrides), args.hf_path)
    m, t = cfg.model, cfg.train
    found = find(recipe.name)
    gpus = args.gpus_per_node or (found.gpus if found and found.gpus else 1)
    world = args.nodes * gpus
    lay = {k: getattr(m, f, 1) or 1 for k, f in (
        ("TP", "tensor_model_parallel_size"), ("PP", "pipeline_model_parallel_size"),
        ("CP", "context_parallel_size"), ("EP", "expert_model_parallel_size"),
    )}  # fmt: skip
    peft = getattr(cfg, "peft", None)
    rows = [
        ["function", recipe.function],
        ["kind", recipe.kind or ("peft" if peft is not None else "pretrain")],
        ["hf model", recipe.hf_model or "-"],
        ["layout", " ".join(f"{k}{v}" for k, v in lay.items())],
        [
            "model",
            f"{m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads, "
            f"seq {m.seq_length}",
        ],
        ["batch", f"global {t.global_batch_size}, micro {t.micro_batch_size}, {t.train_iters} iterations"],
        ["data", describe_data(cfg.dataset)],
    ]
    try:
        est = estimate(cfg, world, te_adapted(notes))
        rows.append([f"memory ({args.nodes}x{gpus} GPUs)", est.describe()])
    except Exception as e:
        rows.append(["memory", f"no estimate ({' '.join(str(e).split())[:120]})"])
    print(format_table(rows))
    for note in notes:
        print(f"note: {note}")
    return 0
