"""Tier 1, with no process started: warm spares and target runners: what is imported ahead (rank/warmup.py,
driver/lifecycle/registry.py)."""

from __future__ import annotations

import os

from launcher.core.launch_args import spec_from_args
from launcher.core.recipes import load_recipe
from launcher.core.target import DRY_RUN_TARGET, Target
from launcher.driver.lifecycle.registry import runner_for
from launcher.rank.probes import wait_gone
from launcher.rank.warmup import warm


def test_spares_import_the_launcher_stack_never_user_code():
    def warm_steps(target):
        return runner_for(target).warm_imports(target)

    assert warm_steps(Target("script", "train.py")) == ("torch", "torch.distributed")
    assert warm_steps(Target("entrypoint", "mypkg.train:main")) == ("torch", "torch.distributed")
    dry = warm_steps(DRY_RUN_TARGET)
    assert "megatron.core.models.gpt" in dry and "launcher.megatron.tiny_gpt" in dry
    recipe = load_recipe("llama3_8b")
    steps = warm_steps(Target("megatron", "llama3_8b", recipe=recipe))
    assert steps.index("launcher.megatron.compat:import_bridge") < steps.index(
        "megatron.bridge.training.pretrain"
    )
    assert recipe.function.partition(":")[0] in steps


def test_every_kind_of_target_has_a_runner_and_plain_programs_resume_themselves():
    from launcher.core.launch_args import spec_from_args
    from launcher.core.target import TargetKind
    from launcher.driver.lifecycle.registry import RUNNERS

    assert set(RUNNERS) == set(TargetKind)
    spec = spec_from_args(["train.py", "--lr", "1"])
    runner = runner_for(spec.target)
    verdict = runner.preflight(spec)  # nothing to check, known at once
    assert verdict.ready() and verdict.result() is None and not verdict.in_background
    assert runner.first_target(spec, None) == spec.target
    assert runner.resume_target(spec.target, None) == spec.target  # TORCHELASTIC_RESTART_COUNT tells it
    assert runner.relays_output and not runner_for(Target("group", "rank group")).relays_output
    assert {f.rsplit("/", 2)[-2] + "/" + f.rsplit("/", 1)[-1] for f in runner.own_files()} == {
        "core/runner.py", "rank/programs.py",
    }  # fmt: skip


def test_a_dry_run_of_no_steps_is_the_check_alone_and_never_imports_megatron():
    plain = runner_for(DRY_RUN_TARGET)
    check = Target(DRY_RUN_TARGET.kind, DRY_RUN_TARGET.name, ("steps=0",))
    assert any(m.startswith("megatron.") for m in plain.warm_imports(DRY_RUN_TARGET))
    assert not any("megatron" in m for m in plain.warm_imports(check))
    assert spec_from_args(["--dry-run", "steps=0"], environ={}).target == check


def test_warm_applies_the_env_first_and_reports_what_did_not_import(monkeypatch):
    monkeypatch.delenv("MEGARAY_TEST_WARM", raising=False)
    result = warm(
        {"MEGARAY_TEST_WARM": "1"},
        ("json", "megaray_no_such_module", "launcher.megatron.compat:te_installed"),
    )
    assert os.environ.pop("MEGARAY_TEST_WARM") == "1"
    assert list(result["failed"]) == ["megaray_no_such_module"]
    assert "ModuleNotFoundError" in result["failed"]["megaray_no_such_module"]
    assert result["cuda_initialized"] is False
    assert "PYTORCH_NVML_BASED_CUDA_CHECK" not in os.environ  # only for the imports


def test_a_spare_waits_for_the_process_it_replaces():
    assert wait_gone(2**22 + 12345, timeout_s=0.1)  # no such pid: gone
    assert not wait_gone(os.getpid(), timeout_s=0.1)  # still here when the wait ends
    assert wait_gone(os.getpid(), timeout_s=60, sooner=lambda: True)  # a spare's GPU with room: at once


def test_a_rank_importing_ahead_of_its_own_program_keeps_what_the_imports_set(tmp_path, monkeypatch):
    # an import that sets a variable (as torch's inductor sets TORCHINDUCTOR_CACHE_DIR): a spare drops
    # it (its program may never import that module), a rank whose program imports it next keeps it
    sets = "import os\nos.environ['MEGARAY_SET_BY_IMPORT'] = '1'\n"
    (tmp_path / "megaray_sets_env.py").write_text(sets)
    (tmp_path / "megaray_sets_env_too.py").write_text(sets)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("MEGARAY_SET_BY_IMPORT", raising=False)
    warm({}, ("megaray_sets_env",))
    assert "MEGARAY_SET_BY_IMPORT" not in os.environ
    warm({}, ("megaray_sets_env_too",), own_program_next=True)
    assert os.environ["MEGARAY_SET_BY_IMPORT"] == "1"
    assert "PYTORCH_NVML_BASED_CUDA_CHECK" not in os.environ  # only for the imports, either way


def test_without_a_gpu_driver_nothing_of_torch_is_changed_and_nvml_says_nothing():
    import torch

    from launcher.rank import nvml

    before = (torch.cuda.get_device_capability, torch.cuda._lazy_init)
    result = warm({}, ("torch",))
    assert (torch.cuda.get_device_capability, torch.cuda._lazy_init) == before
    assert result["cuda_initialized"] is False and result["cuda_initialized_at"] is None
    if not torch.cuda.is_available():  # this machine (CI has no GPU); on a GPU node both answer
        assert nvml.compute_capability() is None and nvml.smallest_memory_gib() is None


def test_a_recipe_pool_imports_bridge_and_the_recipe_and_bad_input_is_said_at_once():
    import pytest

    from launcher.core.errors import UsageError
    from launcher.driver.cluster.pool import PoolLayout

    layout = PoolLayout(1, 2, "gpu", recipe="gpt_small")
    assert "launcher.megatron.compat:import_bridge" in layout.imports
    assert "megatron.bridge.recipes.gpt.vanilla_gpt" in layout.imports
    assert layout.holds == "with Megatron-Bridge and recipe gpt_small imported"
    assert "megatron.core.models.gpt" in PoolLayout(1, 2, "gpu").imports  # the dry run's stack
    assert PoolLayout(1, 2, "gpu", warm=False).imports == ()
    with pytest.raises(UsageError, match="--recipe is what a warm pool imports ahead: add --warm"):
        PoolLayout(1, 2, "gpu", warm=False, recipe="gpt_small")
    with pytest.raises(UsageError, match="unknown recipe 'gpt_huge'"):
        PoolLayout(1, 2, "gpu", recipe="gpt_huge")


def test_the_preflight_hides_the_gpus_only_while_it_runs(monkeypatch):
    from launcher.megatron.preflight import no_gpu_visible

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    with no_gpu_visible():
        assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with no_gpu_visible():
        assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
