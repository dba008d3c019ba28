"""Tier 1, with no process started: Megatron layouts, recipes read from source, memory terms, data paths
(megatron/, core/recipes.py)."""

from __future__ import annotations

import pytest

from launcher.core.errors import RankFailedError, RankFailure


def test_layout_that_fits_has_no_problems():
    from launcher.core.layout import Layout, layout_problems

    deepseek = Layout(tp=8, pp=1, ep=2, global_batch=64, micro_batch=1, num_heads=16, num_query_groups=16,
                      num_experts=64)  # fmt: skip
    assert layout_problems(deepseek, nodes=2, gpus_per_node=8) == []


def test_the_dry_run_keeps_the_tp_or_pp_given_and_takes_megatrons_1_for_the_other():
    from launcher.megatron.tiny_gpt import resolve_layout

    assert resolve_layout(8, 4, None, None) == (2, 2)  # its own: TP inside a node, then PP
    assert resolve_layout(8, 4, 4, None) == (4, 1)  # was (2, 2): the TP given was dropped
    assert resolve_layout(8, 4, None, 4) == (1, 4)
    assert resolve_layout(8, 4, 1, 1) == (1, 1)


def test_layout_problems_print_the_numbers():
    from launcher.core.layout import Layout, layout_problems

    problems = layout_problems(
        Layout(tp=4, pp=3, ep=3, global_batch=10, micro_batch=4, num_heads=6, num_experts=64),
        nodes=2,
        gpus_per_node=2,
    )
    text = "\n".join(problems)
    assert "TP 4 x PP 3 x CP 1 = 12 does not divide world size 4 (--nodes 2 x --gpus-per-node 2)" in text
    assert "TP 4 must fit within one node of 2 GPUs" in text
    assert "expert TP 4 x EP 3 x PP 3 = 36 does not divide world size 4" in text
    assert "EP 3 does not divide the 64 experts" in text
    assert "global batch 10 is not a multiple of micro batch 4 x DP 1 = 4" in text
    assert "TP 4 does not divide the 6 attention heads" in text
    assert len(problems) == 6


def test_failures_pickle_and_print_like_the_cli():
    import pickle

    from launcher.core.errors import Interrupted

    err = RankFailedError(
        [RankFailure(2, "10.0.0.3", "h", "1", "exception", "KeyError: 'x'", "tb", at=1.0)], 4
    )
    again = pickle.loads(pickle.dumps(err))
    assert again.report() == err.report() and str(again) == str(err) and again.exit_code == 1
    stopped = pickle.loads(pickle.dumps(Interrupted(15, "SIGTERM")))
    assert stopped.exit_code == 143 and "SIGTERM" in str(stopped)


def test_the_package_exports_its_public_names_without_importing_ray():
    import subprocess
    import sys

    code = "import launcher, sys; assert 'ray' not in sys.modules; print(sorted(launcher.__all__))"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    import launcher

    assert callable(launcher.launch) and launcher.LaunchResult.__name__ == "LaunchResult"


def test_installed_answers_for_dotted_names_whose_parent_is_missing():
    # find_spec("megatron.core") raises where megatron is absent: the README demo's first failure.
    from launcher.megatron.compat import installed

    assert installed("json.decoder")
    assert not installed("no_such_top_level_pkg.core")
    assert not installed("json.no_such_submodule")


BRIDGE_LIKE_MODULE = """
from megatron.bridge import AutoBridge

HF = "acme/Tiny-7B"

def _common(hf_path):
    cfg = make()
    cfg.model = AutoBridge.from_hf_pretrained(hf_path).to_megatron_provider()
    return cfg

def tiny_7b_pretrain_8gpu_h100_bf16_config():
    cfg = _common(HF)
    cfg.model.tensor_model_parallel_size = 2
    cfg.model.context_parallel_size = 2
    return cfg

def tiny_7b_peft_1gpu_h100_bf16_config(peft_scheme="lora"):
    cfg = tiny_7b_pretrain_8gpu_h100_bf16_config()
    cfg.model.tensor_model_parallel_size = 1
    return cfg

def _private_config():
    pass

def helper():
    pass
"""


def test_bridge_recipes_are_read_from_source_without_importing_it(tmp_path):
    from launcher.core.catalog import scan

    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "h100.py").write_text(BRIDGE_LIKE_MODULE)
    (tmp_path / "tiny" / "__init__.py").write_text("from .h100 import *\n")
    found = {r.name: r for r in scan(tmp_path)}
    assert sorted(found) == ["tiny_7b_peft_1gpu_h100_bf16_config", "tiny_7b_pretrain_8gpu_h100_bf16_config"]
    pre, peft = found["tiny_7b_pretrain_8gpu_h100_bf16_config"], found["tiny_7b_peft_1gpu_h100_bf16_config"]
    assert (pre.family, pre.kind, pre.gpus, pre.hardware, pre.layout) == (
        "tiny",
        "pretrain",
        8,
        "h100",
        "TP2 CP2",
    )
    assert pre.ref == "megatron.bridge.recipes.tiny.h100:tiny_7b_pretrain_8gpu_h100_bf16_config"
    assert pre.hf_model == peft.hf_model == "acme/Tiny-7B"  # through a helper, and through another recipe
    assert (peft.kind, peft.gpus, peft.layout) == ("peft", 1, "TP1")


def test_memory_terms_bridge_leaves_out_by_hand():
    from launcher.core.memory import (
        GIB,
        MemoryEstimate,
        attention_scores_bytes,
        fit_problem,
        frozen_model_state,
        full_recompute_saving,
    )

    # 16 heads, seq 2048, micro 4, 16 layers: 5 x 16 x 2048^2 x 4 bytes per layer = 1.25 GiB
    assert attention_scores_bytes(2048, 4, 16, 16, 1, 1, 1, 2) == 5 * 16 * 2048**2 * 4 * 16
    assert attention_scores_bytes(2048, 4, 16, 16, 2, 2, 1, 2) == 5 * 16 * 2048**2 * 4 * 16 / 4  # TP x CP
    assert attention_scores_bytes(2048, 4, 16, 16, 1, 1, 4, 2) == 5 * 16 * 2048**2 * 4 * 16 / 2  # 2 of PP 4
    # full recompute: 15 of 16 layers keep 2sbh instead of sbh(18 + 4 x 4)
    sbh = 2048 * 4 * 2048
    assert full_recompute_saving(2048, 4, 2048, 16, 4.0, 1, 1) == 15 * 34 * sbh - 16 * 2 * sbh
    assert frozen_model_state(8e9) == 16e9  # bf16 weights only
    est = MemoryEstimate(model_state=60 * GIB, activations=25 * GIB, parameters=8.03e9)
    assert est.describe().startswith(
        "85.0 GiB per GPU at the first step (weights, gradients and optimizer 60.0"
    )
    assert fit_problem(est, 80) == f"needs {est.describe()}, more than the 80 GiB of one GPU"
    assert fit_problem(est, 96) is None


def test_data_paths_a_config_names_are_checked(tmp_path):
    from launcher.core.dataset_paths import blend_prefixes, missing_data

    assert blend_prefixes((["/d/a", "/d/b"], [0.3, 0.7])) == ["/d/a", "/d/b"]
    assert blend_prefixes(["0.3", "/d/a", "0.7", "/d/b"]) == ["/d/a", "/d/b"]
    assert blend_prefixes([["./d/a"], None]) == ["./d/a"]  # the pair, as a YAML override gives it
    assert blend_prefixes(None) == []
    (tmp_path / "a.bin").write_bytes(b"")
    (tmp_path / "a.idx").write_bytes(b"")
    (tmp_path / "b.bin").write_bytes(b"")
    missing = missing_data(
        [str(tmp_path / "a"), str(tmp_path / "b")],
        str(tmp_path / "sft"),
        [
            ("tokenizer.tokenizer_model", "meta-llama/Meta-Llama-3-8B"),
            ("tokenizer.vocab_file", "/no/vocab.json"),
        ],
    )
    assert missing == [
        f"dataset.blend prefix {tmp_path}/b has no {tmp_path}/b.idx",
        f"dataset.dataset_root {tmp_path}/sft is not a folder",
        "tokenizer.vocab_file /no/vocab.json does not exist",
    ]


def test_the_first_step_is_checked_against_the_placed_gpus_unless_a_size_is_given():
    from launcher.core.launch_args import spec_from_args
    from launcher.core.memory import MemoryEstimate
    from launcher.core.progress import TrainingFacts
    from launcher.driver.lifecycle.registry import runner_for
    from launcher.megatron.preflight import Plan

    est = MemoryEstimate(model_state=60 * 2**30, activations=18 * 2**30, parameters=8.03e9)
    plan = Plan(None, "", TrainingFacts(), 10, None, None, est)
    spec = spec_from_args(["--recipe", "gpt_small"])
    runner = runner_for(spec.target)
    assert spec.gpu_memory_gb is None  # the GPUs' own, which the ranks report (rank/nvml.py)
    assert runner.memory_problem(spec, plan, 79.1) is None  # 78 GiB fits an H100 80GB's 79.1
    problem = runner.memory_problem(spec, plan, 39.4)  # an A100 40GB does not
    assert problem.startswith(
        "recipe gpt_small: needs 78.0 GiB per GPU at the first step (weights, gradients and optimizer 60.0 "
        "GiB, activations 18.0 GiB; 8.03B parameters), more than the 39.4 GiB of one GPU (the smallest GPU "
        "placed, from NVML)"
    )
    assert "`--check --gpu-memory-gb 39.4` lists which" in problem
    given = spec_from_args(["--recipe", "gpt_small", "--gpu-memory-gb", "40"])
    assert runner.memory_problem(given, plan, 39.4) is None  # the preflight checked the size given
    assert runner.memory_problem(spec, None, 39.4) is None  # no preflight (no bridge in the driver)


def test_parallel_dims_say_what_data_parallel_is_left_and_refuse_a_size_below_one():
    from launcher.core.layout import Layout, ParallelDims

    assert ParallelDims(2, 2).dp(8) == 2 and ParallelDims(4).dp(6) is None
    assert Layout(tp=2, pp=1, cp=2).dims == ParallelDims(2, 1, 2)
    with pytest.raises(ValueError, match="TP 0, PP 1 and CP 1 must each be at least 1"):
        ParallelDims(0)
