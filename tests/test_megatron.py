"""Megatron-Bridge recipes resolved offline from HF config fixtures, the compatibility fixes, and
the preflight layout check through `main()`. Needs the megatron extra (skipped without it)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("megatron.core") is None or importlib.util.find_spec("megatron.bridge") is None:
    pytest.skip("the megatron extra is not installed", allow_module_level=True)

from launcher.cli import main
from launcher.core.errors import UsageError
from launcher.core.recipes import available_recipes, load_recipe
from launcher.megatron import compat
from launcher.megatron.bridge_target import build_config
from launcher.megatron.facts import facts_from_config
from launcher.megatron.preflight_process import starts_at_once

from .conftest import FIXTURES, REPO, ray_starting


@pytest.fixture(scope="module")
def configs():
    """Every shipped recipe, built once with a command-line override (bridge takes ~20 s to import)."""
    return {
        name: build_config(load_recipe(name), ["logger.log_interval=7"])[0] for name in available_recipes()
    }


def test_shipped_recipes_resolve_offline_with_overrides(configs):
    assert {"deepseek_v2_lite", "llama3_8b", "qwen3_8b", "gpt_small"} <= set(configs)
    assert {name: cfg.logger.log_interval for name, cfg in configs.items()} == dict.fromkeys(configs, 7)


def test_deepseek_v2_lite_has_the_model_card_and_the_recipe_values(configs):
    cfg = configs["deepseek_v2_lite"]
    m = cfg.model
    # from the HF config fixture (the published model card)
    assert (m.num_layers, m.hidden_size, m.num_attention_heads) == (27, 2048, 16)
    assert (m.num_moe_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.kv_lora_rank) == (64, 6, 1408, 512)
    # from recipes/deepseek_v2_lite.yaml
    assert (m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.expert_model_parallel_size) == (
        8,
        1,
        2,
    )
    assert m.sequence_parallel is True and m.seq_length == 4096 and cfg.dataset.seq_length == 4096
    assert m.moe_permute_fusion is False
    assert (cfg.train.train_iters, cfg.train.global_batch_size, cfg.train.micro_batch_size) == (500, 64, 1)
    assert (cfg.validation.eval_interval, cfg.scheduler.lr_warmup_iters) == (100, 50)
    assert cfg.checkpoint.save is None


def test_llama_and_qwen_have_the_model_card_values(configs):
    llama, qwen = configs["llama3_8b"].model, configs["qwen3_8b"].model
    assert (llama.num_layers, llama.hidden_size, llama.ffn_hidden_size, llama.num_query_groups) == (
        32,
        4096,
        14336,
        8,
    )
    assert llama.rotary_base == 500000
    assert (qwen.num_layers, qwen.hidden_size, qwen.ffn_hidden_size, qwen.num_query_groups) == (
        36,
        4096,
        12288,
        8,
    )
    assert qwen.qk_layernorm is True
    assert configs["qwen3_8b"].tokenizer.tokenizer_type == "NullTokenizer"


def test_without_te_the_precision_aware_optimizer_falls_back_to_megatrons_adam():
    # qwen3_8b asks for TE's FusedAdam; without TE every rank raised at its first step (GPU suite).
    assert not compat.te_installed()
    cfg, notes = build_config(load_recipe("qwen3_8b"), [])
    assert cfg.optimizer.use_precision_aware_optimizer is False
    assert "no TransformerEngine here: optimizer.use_precision_aware_optimizer=False" in notes
    # and its loss is TE's fused cross entropy ("Trying to use a TE block when it's not present")
    assert cfg.model.cross_entropy_loss_fusion is False


def test_flops_per_token_is_megatrons_formula_for_llama3_8b_at_8192():
    # Published figure: about 51.5e9 FLOPs per token (forward + backward, attention counted causal):
    # 6 x 6.98e9 non-embedding parameters + the output layer + causal attention 6 x L x h x s.
    cfg = build_config(load_recipe("llama3_8b"), ["model.seq_length=8192", "dataset.seq_length=8192"])[0]
    facts = facts_from_config(cfg)
    assert facts.flops_per_token == pytest.approx(51.5e9, rel=0.005)
    assert (facts.seq_length, facts.global_batch) == (8192, cfg.train.global_batch_size)


def test_flops_per_token_for_gpt_small_fills_what_bridge_sets_only_at_training():
    # kv_channels, query groups and the vocabulary are None until bridge finalizes the model at the
    # start of training; the driver's formula fills them as bridge will (hidden / heads, the heads,
    # the tokenizer's vocabulary). By hand, per token, forward x 3 for training, 2 FLOPs per MAC: per
    # layer QKV 6h^2 + output 2h^2 + MLP 4h*ffn + causal attention 2sh; then the logits 2hV.
    cfg = build_config(load_recipe("gpt_small"), [])[0]
    h, ffn, layers, seq, vocab = 2048, 8192, 16, 2048, 32000
    per_token = 3 * (layers * (8 * h * h + 4 * h * ffn + 2 * seq * h) + 2 * h * vocab)
    assert facts_from_config(cfg).flops_per_token == pytest.approx(per_token, rel=1e-6)
    assert cfg.model.kv_channels is None  # the config itself is left as bridge made it


def test_override_values_must_fit_the_declared_type(capsys):
    assert main(["--recipe", "gpt_small", "--check", "train.train_iters=abc"]) == 2
    assert "train_iters takes int or None, got 'abc' (str)" in capsys.readouterr().err
    assert main(["--recipe", "gpt_small", "--check", "train.micro_batch_size=xyz"]) == 2
    err = capsys.readouterr().err
    assert "micro_batch_size takes int or None, got 'xyz'" in err and "Traceback" not in err


@pytest.mark.slow  # processes of its own that import Megatron: out of the fast loop
def test_check_prints_only_what_megaray_found():
    # megatron-core and bridge warn ~30 lines about the driver's machine as they import (no TE, no
    # Apex, no CUDA runtime): the preflight's own lines are what a user reads.
    import subprocess

    p = subprocess.run([sys.executable, "main.py", "--recipe", "gpt_small", "--check"], cwd=REPO,
                       capture_output=True, text=True, timeout=180)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    assert all(line.startswith("megaray: ") for line in p.stderr.splitlines()), p.stderr[:3000]
    assert "memory 44.2 GiB per GPU" in p.stderr


def test_an_hf_config_that_cannot_be_had_offline_exits_2_at_once(tmp_path):
    """Refused before bridge is imported (it took 12 CPU-s to say so)."""
    import subprocess
    import sys
    import time

    env = {**os.environ, "HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "main.py", "--recipe", "llama3_8b", "--check"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert p.returncode == 2 and time.monotonic() - t0 < 60, p.stderr[-2000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "megaray: error: recipe llama3_8b builds its model from meta-llama/Meta-Llama-3-8B"
    )
    assert "--hf-path DIR" in last and "HF_HUB_OFFLINE is set" in last and "Traceback" not in p.stderr


def test_while_bridge_imports_the_installed_distributions_are_listed_once():
    """transformers and diffusers each list them as they import (a CPU-second each on 2 cores): the
    second is given a copy of the first's answer, and the standard library's function is back after."""
    import importlib.metadata

    real = importlib.metadata.packages_distributions
    with compat.distributions_listed_once():
        first = importlib.metadata.packages_distributions()
        first["megaray-test"] = ["changed by its caller"]
        second = importlib.metadata.packages_distributions()
    assert importlib.metadata.packages_distributions is real
    assert "megaray-test" not in second and second["torch"] == ["torch"] and second is not first


def test_relaunches_resume_from_the_recipe_checkpoints_and_nccl_outlasts_the_hang_timeout(configs, tmp_path):
    from launcher.core.launch_args import spec_from_args
    from launcher.driver.lifecycle.registry import runner_for
    from launcher.megatron.preflight import Plan

    spec = spec_from_args(["--recipe", "gpt_small", "--hang-timeout", "900", f"checkpoint.save={tmp_path}"])
    runner = runner_for(spec.target)
    align_timeouts, resume_target = runner.first_target, runner.resume_target
    cfg = build_config(spec.target.recipe, list(spec.target.args))[0]
    plan = Plan.of(None, cfg)
    assert cfg.dist.distributed_timeout_minutes * 60 <= 900  # bridge's default would fire first
    first = align_timeouts(spec, plan)
    assert first.args[-1] == "dist.distributed_timeout_minutes=17"
    again = resume_target(first, plan)
    assert again.args[-1] == f"checkpoint.load={tmp_path}"
    assert build_config(spec.target.recipe, list(again.args))[0].checkpoint.load == str(tmp_path)
    short = spec_from_args(["--recipe", "gpt_small", "--hang-timeout", "60"])
    assert align_timeouts(short, plan) == short.target  # 10 minutes already outlast a minute


@pytest.mark.slow  # builds gpt_small's config four times: ~12 s of the fast loop
def test_a_config_built_ahead_on_a_rank_is_taken_with_the_overrides_the_go_adds(tmp_path):
    """A rank (or a warm spare) builds its recipe's config while it waits for the go; the program
    takes it, with what the go added (a collective timeout, a relaunch's checkpoint.load) applied,
    the same config as built from scratch; anything else is built anew."""
    from launcher.core.launch_args import spec_from_args
    from launcher.driver.lifecycle.registry import runner_for
    from launcher.megatron.bridge_target import take_prebuilt
    from launcher.megatron.preflight import Plan

    spec = spec_from_args(["--recipe", "gpt_small", "--hang-timeout", "900", f"checkpoint.save={tmp_path}"])
    runner, recipe = runner_for(spec.target), spec.target.recipe
    runner.prepare(spec.target)  # what a rank does after its imports (rank/warmup.py)
    plan = Plan.of(None, build_config(recipe, list(spec.target.args))[0])
    go = runner.resume_target(runner.first_target(spec, plan), plan)
    cfg, notes = take_prebuilt(recipe, list(go.args), None)
    fresh, fresh_notes = build_config(recipe, list(go.args))
    assert (cfg.dist.distributed_timeout_minutes, cfg.checkpoint.load) == (17, str(tmp_path))
    assert cfg.to_dict() == fresh.to_dict() and notes == fresh_notes
    assert take_prebuilt(recipe, list(go.args), None) is None  # taken once
    runner.prepare(spec.target)
    assert take_prebuilt(recipe, ["model.num_layers=3"], None) is None  # not what was built: anew


def test_a_finetuning_relaunch_resumes_from_its_own_checkpoints_once_it_has_saved_one(tmp_path):
    # Bridge's SFT recipes load from their default save folder; with checkpoint.save given alone, the
    # relaunch must load from there once the first attempt saved, and from the pretrained weights before.
    from launcher.core.launch_args import spec_from_args
    from launcher.driver.lifecycle.registry import runner_for
    from launcher.megatron.preflight import Plan

    save = tmp_path / "ft"
    spec = spec_from_args(["--recipe", "llama3_8b_sft_2gpu_h100_bf16_config", "--nodes", "1",
                           "--gpus-per-node", "2", f"checkpoint.pretrained_checkpoint={tmp_path / 'pre'}",
                           f"checkpoint.save={save}"])  # fmt: skip
    resume_target = runner_for(spec.target).resume_target
    cfg = build_config(spec.target.recipe, list(spec.target.args))[0]
    assert cfg.checkpoint.load not in (None, str(save))  # the recipe's own folder
    plan = Plan.of(None, cfg)
    assert resume_target(spec.target, plan) == spec.target  # nothing saved yet
    save.mkdir()
    (save / "latest_checkpointed_iteration.txt").write_text("50")
    again = resume_target(spec.target, plan)
    assert again.args[-1] == f"checkpoint.load={save}"
    assert build_config(spec.target.recipe, list(again.args))[0].checkpoint.load == str(save)
    given = spec_from_args(["--recipe", "llama3_8b_sft_2gpu_h100_bf16_config", f"checkpoint.save={save}",
                            "checkpoint.load=/mine"])  # fmt: skip
    assert resume_target(given.target, plan) == given.target  # the user's own load is kept


def test_command_line_overrides_beat_the_recipe_file_which_beats_bridge():
    recipe = load_recipe("gpt_small")
    cfg, _ = build_config(recipe, ["model.num_layers=2", "train.train_iters=7"])
    assert (cfg.model.num_layers, cfg.train.train_iters) == (2, 7)  # command line
    assert cfg.model.hidden_size == 2048  # recipe file (bridge's default is different)
    assert cfg.train.micro_batch_size == 4


def test_bad_override_names_the_key():
    with pytest.raises(
        UsageError, match=r"override 'model\.no_such_key=3' from the command line.*'model\.no_such_key'"
    ):
        build_config(load_recipe("gpt_small"), ["model.no_such_key=3"])


def test_hf_path_reads_a_local_model_folder(tmp_path):
    folder = tmp_path / "my-llama"
    folder.mkdir()
    config = json.loads((FIXTURES / "hf" / "meta-llama--Meta-Llama-3-8B" / "config.json").read_text())
    config["num_hidden_layers"] = 4
    (folder / "config.json").write_text(json.dumps(config))
    cfg, _ = build_config(load_recipe("llama3_8b"), [], hf_path=str(folder))
    assert cfg.model.num_layers == 4


def test_bridge_imports_without_te_and_the_placeholder_stays_private(configs):
    if compat.te_installed():
        pytest.skip("TransformerEngine is installed: the real one is used")
    assert "transformer_engine" not in sys.modules
    import megatron.bridge.peft.lora_layers as lora
    from megatron.bridge.models.gpt_provider import local_layer_spec

    assert lora.te.__name__ == "transformer_engine.pytorch"
    with pytest.raises(ImportError, match="needs TransformerEngine"):
        lora.te.Linear()
    model = configs["gpt_small"].model
    assert model.transformer_layer_spec is local_layer_spec
    assert not any(getattr(model, f) for f in compat.FUSIONS_NEEDING_KERNELS)


def test_compile_helpers_is_skipped_when_the_wheel_ships_them():
    from pathlib import Path

    import megatron.bridge.training.initialize as initialize
    import megatron.core.datasets as datasets

    shipped = not (Path(datasets.__file__).parent / "Makefile").exists()
    assert compat.skip_compile_helpers_if_prebuilt() is shipped
    if shipped:
        assert initialize.compile_helpers() is None  # no `make`, no sys.exit(1)


def test_check_accepts_a_layout_that_fits(capsys):
    assert main(["--check", "--recipe", "deepseek_v2_lite", "--nodes", "2", "--gpus-per-node", "8"]) == 0
    assert "TP 8 x PP 1 x CP 1, EP 2 (expert TP 8), global batch 64, micro batch 1, DP 2 fits 16" in (
        capsys.readouterr().err
    )


def test_check_with_a_node_range_accepts_the_counts_the_layout_fits(capsys):
    """--nodes 2:3 x 8 GPUs: 24 GPUs cannot take expert TP 8 x EP 2 nor a global batch of 64 at DP 3;
    16 can. The launch would skip 3 (core/elastic.py); the check says which counts fit."""
    assert main(["--check", "--recipe", "deepseek_v2_lite", "--nodes", "2:3", "--gpus-per-node", "8"]) == 0
    assert "the layout fits 2 of --nodes 2:3 node(s)" in capsys.readouterr().err
    assert main(["--check", "--recipe", "deepseek_v2_lite", "--nodes", "3:3", "--gpus-per-node", "8"]) == 2


@pytest.mark.slow  # a local Ray and the preflight's own process importing bridge: ~50 CPU-seconds
def test_a_layout_that_does_not_fit_exits_2_and_leaves_nothing(capsys, tmp_path):
    # the preflight runs beside connecting and placing (megatron/preflight_process.py): its refusal is
    # the error told, even where placing failed first (no GPUs here), and no run directory is left.
    # In a process with bridge imported (a notebook's), the launch waiting for it, it answers there
    # instead of in a process that would import bridge again.
    import megatron.bridge  # noqa: F401
    import ray

    runs = tmp_path / "runs"
    argv = ["--recipe", "deepseek_v2_lite", "--nodes", "1", "--gpus-per-node", "4", "--runs-dir", str(runs)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    if not starts_at_once(os.cpu_count() or 1, 4):  # where it does, its process started with the launch
        assert "preflight in the driver, bridge imported here" in err, err[-3000:]
    assert "TP 8 must fit within one node of 4 GPUs" in err
    assert "TP 8 x PP 1 x CP 1 = 8 does not divide world size 4 (--nodes 1 x --gpus-per-node 4)" in err
    assert "Traceback" not in err and not ray.is_initialized()
    assert not runs.exists() or not any(runs.iterdir())


def test_the_preflights_process_starts_at_once_only_with_a_core_to_spare_beside_the_ranks():
    assert starts_at_once(cores=16, ranks_per_node=8) and starts_at_once(cores=3, ranks_per_node=1)
    assert not starts_at_once(cores=2, ranks_per_node=1) and not starts_at_once(cores=8, ranks_per_node=8)


def test_unknown_recipe_lists_the_files_and_suggests_bridge_s_own(capsys):
    assert main(["--recipe", "gpt_huge"]) == 2
    err = capsys.readouterr().err
    assert (
        "unknown recipe 'gpt_huge': not a file under recipes/ (deepseek_v2_lite, gpt_small, gpt_small_text, "
        "llama3_8b, " in err
    )
    assert "`megaray recipes` lists them all" in err and err.count("\n") == 1
    assert main(["--recipe", "llama3_8b_pretrain_2gpu_h100_bf16", "--check"]) == 2
    assert "did you mean llama3_8b_pretrain_2gpu_h100_bf16_config" in capsys.readouterr().err


LLAMA3_8B = "llama3_8b_pretrain_2gpu_h100_bf16_config"


@pytest.mark.parametrize("name", [LLAMA3_8B, f"megatron.bridge.recipes.llama.h100.llama3:{LLAMA3_8B}"])
def test_a_bridge_recipe_by_name_runs_the_preflight_and_fits_its_own_layout(capsys, name):
    # bridge's layout for it (TP1 PP1 CP2) on one 8-GPU node: DP 4 shards the distributed optimizer
    assert main(["--check", "--recipe", name, "--nodes", "1", "--gpus-per-node", "8"]) == 0
    err = capsys.readouterr().err
    assert "TP 1 x PP 1 x CP 2" in err and "DP 4 fits 8 rank(s)" in err
    assert re.search(
        r"preflight: memory 7\d\.\d GiB per GPU at the first step .*8\.03B parameters\), of 80 GiB", err
    )


@pytest.mark.slow  # a local Ray and the preflight's own process importing bridge: ~50 CPU-seconds
def test_llama3_8b_on_one_gpu_is_refused_for_memory_with_the_numbers(capsys):
    import ray

    argv = ["--recipe", LLAMA3_8B, "--nodes", "1", "--gpus-per-node", "1"]
    assert main([*argv, "--gpu-memory-gb", "80", "model.context_parallel_size=1"]) == 2
    err = capsys.readouterr().err
    assert "more than the 80 GiB of one GPU" in err and "weights, gradients and optimizer 134.6 GiB" in err
    assert err.count("megaray: error:") == 1 and not ray.is_initialized()
    bigger = [*argv, "--gpu-memory-gb", "200", "--check", "model.context_parallel_size=1"]
    assert main(bigger) == 0  # a bigger GPU takes it


def test_the_gpt_small_estimate_is_within_25_percent_of_its_measured_peak():
    from launcher.megatron.memory import estimate

    cfg, _ = build_config(load_recipe("gpt_small"), [])
    measured = 46.3  # GiB, torch.cuda.max_memory_allocated on one H100 (bench/RESULTS.md)
    est = estimate(cfg, 1).total / 2**30
    assert abs(est - measured) / measured < 0.25, est


def test_finetuning_needs_pretrained_weights_and_passes_check_with_them(tmp_path, capsys):
    sft = [
        "--check",
        "--recipe",
        "llama3_8b_sft_2gpu_h100_bf16_config",
        "--nodes",
        "1",
        "--gpus-per-node",
        "2",
    ]
    assert main(sft) == 2
    err = capsys.readouterr().err
    assert "finetunes pretrained weights: pass checkpoint.pretrained_checkpoint=DIR" in err
    assert "AutoBridge.import_ckpt('meta-llama/Meta-Llama-3-8B', 'DIR')" in err
    assert main([*sft, f"checkpoint.pretrained_checkpoint={tmp_path}"]) == 0
    peft = [
        "--check",
        "--recipe",
        "llama3_8b_peft_1gpu_h100_bf16_config",
        f"checkpoint.pretrained_checkpoint={tmp_path}",
    ]
    assert main(peft) == 0
    assert "PEFT: the base weights are frozen" in capsys.readouterr().err


def test_data_the_config_names_but_is_not_there_is_named(tmp_path, capsys):
    (tmp_path / "corpus.bin").write_bytes(b"")
    blend = f"dataset.blend=[{tmp_path}/corpus]"
    assert main(["--check", "--recipe", "gpt_small", blend]) == 2
    assert f"dataset.blend prefix {tmp_path}/corpus has no {tmp_path}/corpus.idx" in capsys.readouterr().err
    (tmp_path / "corpus.idx").write_bytes(b"")
    assert main(["--check", "--recipe", "gpt_small", blend]) == 0


def test_recipes_lists_every_bridge_recipe_and_shows_one_resolved(capsys):
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\n\d+ of Megatron-Bridge's (2[5-9]\d|3\d\d) recipes", out)
    assert re.search(
        r"llama3_8b_peft_1gpu_h100_bf16_config +llama +peft +1 +TP1 PP1 CP1 +meta-llama/Meta-Llama-3-8B", out
    )
    assert main(["recipes", "--family", "qwen", "--kind", "sft"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert len(rows) > 5 and all(" qwen " in r and " sft " in r for r in rows[1:-2])  # no recipe files
    assert main(["recipes", LLAMA3_8B, "--gpus-per-node", "8"]) == 0
    shown, said = capsys.readouterr()
    assert f"building recipe {LLAMA3_8B} with Megatron-Bridge" in said  # first: bridge takes seconds
    assert "layout             TP1 PP1 CP2 EP1" in shown and "meta-llama/Meta-Llama-3-8B" in shown
    assert "memory (1x8 GPUs)" in shown


def test_recipes_are_found_in_the_checkout_or_a_wheel(tmp_path):
    from launcher.core import recipes

    assert recipes.recipe_dirs()[0].name == "recipes"
    copy = tmp_path / "mine.yaml"
    shutil.copy(recipes.recipe_dirs()[0] / "gpt_small.yaml", copy)
    assert load_recipe(str(copy)).name == "mine"


@pytest.mark.slow  # processes of its own that import Megatron: out of the fast loop
def test_cpu_adaptation_touches_only_megatron_modules():
    """In a fresh process: the dry run imports megatron-core without torch's compiler (its fused
    kernels are off in the trainer's config) and torch.compile is left as it was, and without the
    optional packages it never uses, which import again afterwards; global torch keeps its CUDA
    behaviour, megatron modules get the proxy."""
    import subprocess

    code = """
import importlib.util, sys, torch
from launcher.megatron.tiny_gpt import DRY_RUN_NOT_INSTALLED, import_megatron_core
compile_ = torch.compile
import_megatron_core()
assert torch.compile is compile_
assert "torch._dynamo" not in sys.modules and "torch._inductor" not in sys.modules
assert not set(DRY_RUN_NOT_INSTALLED) & set(sys.modules), DRY_RUN_NOT_INSTALLED
for name in DRY_RUN_NOT_INSTALLED:  # where installed (Megatron-Bridge's stack), importable again
    if importlib.util.find_spec(name) is not None:
        importlib.import_module(name)
import megatron.core.utils as mu, megatron.core.pipeline_parallel.schedules as sch
from megatron.core.tensor_parallel import random
from launcher.megatron.cpu_megatron import adapt_megatron_to_cpu, CpuRNGStatesTracker
adapt_megatron_to_cpu()
assert mu.torch is not torch and sch.torch is not torch
assert mu.torch.cuda.current_device() == torch.device("cpu")
assert mu.torch.empty(2, device="cuda").device.type == "cpu"
assert torch.cuda.current_device is torch.cuda.__dict__["current_device"]  # global torch untouched
try:
    torch.empty(2, device="cuda")
    raise SystemExit("global torch was redirected")
except (RuntimeError, AssertionError):
    pass
tracker = random.get_cuda_rng_tracker()
assert isinstance(tracker, CpuRNGStatesTracker)
tracker.add("model-parallel-rng", 7)
before = torch.get_rng_state()
with tracker.fork():
    a = torch.rand(1)
assert torch.equal(before, torch.get_rng_state())
print("ok")
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stdout + p.stderr


@pytest.mark.slow  # processes of its own that import Megatron: out of the fast loop
# its Ctrl-C comes 3 s after Python's own handler is in place, timed for a driver past its own imports:
# beside the sixteen-ranks test (load 27 on 2 cores) a fresh-clone run's had not started Python by 3 s
# after its start (exit -2, no handler yet), another's not finished importing megaray (Python's
# traceback): never beside a busy test, and beside anything else (as `alone` it waited 33 s for the
# other workers' Ray starts in a fresh-clone run)
@pytest.mark.quiet
@pytest.mark.parametrize("check", [True, False])
def test_ctrl_c_during_the_preflight_exits_130_in_one_line(check):
    import signal
    import subprocess
    import sys
    import time

    args = [sys.executable, "main.py", "--recipe", "gpt_small", "--device", "cpu", "--job-name", "ctrlc"]
    p = subprocess.Popen(
        [*args, *(["--check"] if check else [])], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not sigint_caught(p.pid):  # Python's handler: a Ctrl-C from here on is a KeyboardInterrupt
        assert p.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(3)  # importing Megatron-Bridge for the preflight takes longer
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    said = err if len(err) < 6000 else f"{err[:3000]}\n[...]\n{err[-3000:]}"  # where the Ctrl-C landed
    assert p.returncode == 130, said
    assert "Traceback" not in err and "interrupted by SIGINT" in err, said


def sigint_caught(pid: int) -> bool:
    """Whether the process has a handler for SIGINT (its SigCgt mask, bit 2 - 1)."""
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(re.search(r"^SigCgt:\s*([0-9a-f]+)$", status, re.M).group(1), 16)
    return bool(caught & (1 << (signal.SIGINT - 1)))


@pytest.mark.slow  # processes of its own that import Megatron: out of the fast loop
def test_real_data_made_by_megatron_preprocessing_trains_the_dry_run_and_passes_the_preflight(
    tmp_path, capsys
):
    # As the Megatron guide gives it: text files in the repository -> a tokenizer -> Megatron's preprocessing.
    import subprocess

    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "examples/data/prepare.py", "--out", str(out)], cwd=REPO,
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    prefix = out / "corpus_text"
    assert (out / "corpus_text.bin").stat().st_size > 10_000 and (out / "corpus_text.idx").is_file()
    # the recipe's preflight finds the data and the tokenizer, and takes the vocabulary from it
    data = [f"dataset.blend=[[{prefix}],null]", f"tokenizer.tokenizer_model={out / 'tokenizer'}"]
    assert main(["--recipe", "gpt_small_text", "--check", *data]) == 0
    err = capsys.readouterr().err
    assert re.search(r"preflight: memory [\d.]+ GiB per GPU .*0\.81B parameters", err), err[-2000:]
    assert main(["--recipe", "gpt_small_text", "--check", "dataset.blend=[[/nowhere/x],null]"]) == 2
    assert "dataset.blend prefix /nowhere/x has no /nowhere/x.bin" in capsys.readouterr().err
    # the dry run's tiny Megatron GPT, on two CPU ranks, learns the text
    cmd = [sys.executable, "main.py", "--runs-dir", str(tmp_path / "runs"), "--dry-run", "--nodes", "1",
           "--gpus-per-node", "2", f"data={prefix}", "steps=30"]  # fmt: skip
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+) over 30 steps", p.stderr).groups())
    assert first > 6.5 and last < first - 0.5  # from ln(1024) = 6.93, the tokenizer's vocabulary


def test_the_exit_signal_is_a_flag_while_training_and_the_old_handler_after():
    """The dry run's `exit_signal_handler=true` (megatron/exit_signal.py): SIGTERM sets a flag instead of
    ending the process, and the handler that was there before is back afterwards."""
    import os
    import signal

    from launcher.megatron.exit_signal import ExitSignal

    before = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        with ExitSignal() as stop:
            assert not stop.received
            os.kill(os.getpid(), signal.SIGTERM)
            assert stop.received
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, before)


class Forwarder:
    """Takes a rank's samples as its node's forwarder does (`forwarder.sample.remote(s)`)."""

    def __init__(self):
        self.sample, self.got = self, []

    def remote(self, sample) -> None:
        self.got.append(sample)


def test_the_timed_forward_step_keeps_bridges_signature_and_sends_its_step_times():
    """bridge passes its GlobalState to a forward step whose signature asks for it: megaray's timed
    one must keep bridge's signature, or bridge would call it without its state."""
    import time

    from launcher.megatron.steptimes import StepTimer, timed

    compat.import_bridge()
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.utils.train_utils import needs_global_state_injection

    assert timed(forward_step) is forward_step  # outside a launch: unchanged
    wrapped = timed(forward_step, sink=Forwarder())
    assert wrapped is not forward_step and needs_global_state_injection(wrapped)

    forwarder, now = Forwarder(), [0.0]
    timer = StepTimer(forwarder, rank=5, world_size=8, clock=lambda: now[0])
    started = time.perf_counter()
    for _ in range(3):
        timer.call(time.sleep, (0.02,), {})
    now[0] = 10.0
    timer.call(time.sleep, (0.02,), {})
    took = time.perf_counter() - started  # the steps' time, at most: a loaded machine's (2.4 s once)
    (sample,) = forwarder.got
    assert (sample.rank, sample.stage, sample.steps) == (5, 0, 4) and 0.08 <= sample.seconds <= took


# the driver as main.py runs it, then whether it imported torch or Megatron itself
DRIVER_IMPORTS = """
import sys
from launcher.cli.main import main
code = main(sys.argv[1:])
print("driver imported:", [m for m in ("torch", "megatron.core", "megatron.bridge") if m in sys.modules])
sys.exit(code)
"""


@pytest.mark.slow  # a local Ray, a rank importing bridge, a warm pool importing it: about 70 CPU-seconds
def test_the_ranks_import_while_the_preflight_runs_and_a_warm_recipe_pool_answers_for_it(tmp_path):
    """The preflight runs in a process of its own beside connecting and placing; the ranks import
    their stack meanwhile, and the program starts once the verdict is in. On `megaray up --warm
    --recipe`, the pool's process (bridge imported) builds the config instead. Bridge's pretrain()
    cannot run on a CPU: the launches end in the program, which is what shows it was started."""
    import subprocess
    import tempfile

    from . import drive

    env = drive.user_env(drop=("RAY_AUTH_",), HF_HUB_OFFLINE="1")
    env["MEGARAY_STATE_DIR"] = tempfile.mkdtemp(prefix="mru-", dir="/tmp")
    env["HOME"] = str(tmp_path / "home")
    args = ["--recipe", "gpt_small", "--device", "cpu", "--runs-dir", str(tmp_path / "runs")]
    try:
        cold = subprocess.run(
            [sys.executable, "-c", DRIVER_IMPORTS, *args, "--job-name", "cold", "train.train_iters=2"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        err = cold.stderr
        assert cold.returncode == 1 and "in train_recipe" in err, err[-3000:]  # the program ran
        assert "driver imported: []" in cold.stdout  # the preflight's imports are its own process's
        started = err.index("the ranks import torch, torch.distributed, launcher.megatron.compat:")
        assert started < err.index("preflight: TP 1 x PP 1 x CP 1") < err.index("Root cause")
        if not starts_at_once(os.cpu_count() or 1, 1):  # no core to spare for the preflight's process
            assert re.search(r"preflight in rank 0's process, bridge imported there \([\d.]+ s\)", err)
        assert "train_iters: 2" in (tmp_path / "runs" / "cold" / "config.yaml").read_text()
        with ray_starting():  # Ray gives its node 30 s (conftest.ray_starting)
            up = drive.run("up", "--warm", "--recipe", "gpt_small", "--gpus-per-node", "1", env=env)
        assert up.returncode == 0 and "with Megatron-Bridge and recipe gpt_small imported" in up.stderr, (
            up.stderr[-2000:]
        )
        warm = drive.run(*args, "--job-name", "warm", "train.train_iters=2", env=env)
        err = warm.stderr
        assert warm.returncode == 1 and "in train_recipe" in err, err[-3000:]
        assert "taking the warm pool (1 processes with Megatron-Bridge and recipe gpt_small imported)" in err
        assert re.search(r"preflight in a warm pool's process, bridge imported there \([\d.]+ s\)", err)
        assert "the ranks import" not in err and "preflight: TP 1 x PP 1 x CP 1" in err
    finally:
        down = drive.run("down", env=env)
        shutil.rmtree(env["MEGARAY_STATE_DIR"], ignore_errors=True)
    assert down.returncode == 0, down.stderr[-2000:]
