"""Tier 1, with no process started: the launch spec from argv and its validation; bad input in one line
(core/spec.py, cli/)."""

from __future__ import annotations

import pytest

from launcher.cli import main
from launcher.core.errors import UsageError
from launcher.core.launch_args import spec_from_args
from launcher.core.spec import LaunchSpec
from launcher.core.target import DRY_RUN_TARGET, Target


def test_spec_from_args_reads_the_torchrun_shape(tmp_path):
    spec = spec_from_args(
        ["--nodes", "2", "--gpus-per-node", "8", "train.py", "--lr", "3e-4"],
        environ={"RAY_ADDRESS": "127.0.0.1:6379"},
        cwd=str(tmp_path),
    )
    assert (spec.nodes, spec.gpus_per_node, spec.world_size) == (2, 8, 16)
    assert spec.target == Target("script", "train.py", ("--lr", "3e-4"))
    assert spec.address == "127.0.0.1:6379" and spec.job_name.startswith("megaray-")
    ep = spec_from_args(["--entrypoint", "pkg.mod:fn", "x", "--y"], environ={})
    assert ep.target == Target("entrypoint", "pkg.mod:fn", ("x", "--y")) and ep.address is None
    with pytest.raises(AttributeError):
        spec.nodes = 3  # frozen
    assert spec.spares and not spec_from_args(["--no-spares", "--dry-run"], environ={}).spares


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nodes", "0", "--dry-run"], "--nodes must be at least 1, got 0"),
        (["--gpus-per-node", "-2", "--dry-run"], "--gpus-per-node must be at least 1, got -2"),
        (["--placement-timeout", "0", "--dry-run"], "--placement-timeout must be above 0 seconds, got 0.0"),
        (["--master-port", "70000", "--dry-run"], "--master-port must be within 1-65535, got 70000"),
        (["--job-name", "a b", "--dry-run"], "--job-name 'a b' must be"),
        (["--entrypoint", "m:f", "--dry-run"], "--dry-run runs the built-in check"),
        (["--entrypoint", "nocolon"], "is not of the form pkg.module:function"),
        ([], "nothing to run"),
        (["--device", "tpu", "--dry-run"], "invalid choice: 'tpu'"),
        (["--device", "cpu", "--cpus-per-rank", "0", "--dry-run"], "--cpus-per-rank must be above 0"),
        (["--kill-grace", "nan", "--dry-run"], "argument --kill-grace: must be a finite number, got 'nan'"),
        (["--placement-timeout", "inf", "--dry-run"], "--placement-timeout: must be a finite number"),
        (["--hang-timeout", "1e400", "--dry-run"], "--hang-timeout: must be a finite number"),
        (["up", "--cpus-per-rank", "-1"], "--cpus-per-rank must be above 0 with --device cpu, got -1.0"),
        (["up", "--idle-timeout", "nan"], "argument --idle-timeout: must be a finite number, got 'nan'"),
        (["up", "--nodes", "0"], "--nodes must be at least 1, got 0"),
        (["up", "--gpus-per-node", "100000"], "100000 CPU ranks would be 100000 processes on this machine"),
        (["--device", "cpu", "--gpus-per-node", "100000", "--dry-run"], "which holds at most"),
        (["--dry-run", "--nodes", "1:99999999999999999999"], "99999999999999999999 CPU ranks would be"),
        (["--job-name", "nl\n", "--dry-run"], "--job-name 'nl\\n' must be"),
        (["--entrypoint", "m:f\n"], "is not of the form pkg.module:function"),
        (
            ["--gpus-per-node", "4", "--log-ranks", "1-0", "--dry-run"],
            "the range 1-0 runs backwards (write 0-1)",
        ),
        (["--gpus-per-node", "4", "--log-ranks", "3-1,x", "--dry-run"], "(write 1-3); 'x' is not a rank"),
        (["--recipe", "./nope.yaml"], "recipe file ./nope.yaml not found"),
        (["--address", "http://127.0.0.1:8265", "--dry-run"], "is a dashboard's URL, which `megaray submit`"),
        (["--address", "http://[::1", "--dry-run"], "is a dashboard's URL"),
        (["--dry-run", "steps=-1"], "--dry-run 'steps=-1': steps must be at least 0"),
        (["--dry-run", "save_every=0"], "--dry-run 'save_every=0': save_every must be at least 1"),
        (
            ["--dry-run", "exit_signal_handler=maybe"],
            "--dry-run 'exit_signal_handler=maybe': exit_signal_handler must be true or false",
        ),
    ],
)
def test_bad_input_exits_2_with_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1


def test_spec_validates_itself():
    with pytest.raises(ValueError, match="--nodes must be at least 1, got -1"):
        LaunchSpec(nodes=-1, gpus_per_node=1, target=Target("script", "x.py"), job_name="j")
    with pytest.raises(ValueError, match="--kill-grace must be a finite number, got nan"):
        LaunchSpec(
            nodes=1, gpus_per_node=1, target=Target("script", "x.py"), job_name="j", kill_grace_s=float("nan")
        )


def check_target_locally(target: Target, cwd: str) -> None:
    """What the launch does first with its target (driver/lifecycle/launch.py): its runner's local checks."""
    from launcher.driver.lifecycle.registry import runner_for

    runner_for(target).check_locally(target, cwd)


def test_each_kind_of_target_is_described_by_its_runner():
    """The registry's hooks (core/runner.py): a new kind of target says how it reads in its own module."""
    from launcher.core.target import GROUP_TARGET
    from launcher.driver.lifecycle.registry import RUNNERS, runner_for

    shown = {
        kind: runner_for(Target(kind, name, ("a=1",))).describe(Target(kind, name, ("a=1",)))
        for kind, name in [("script", "train.py"), ("module", "pkg.train"), ("entrypoint", "pkg.train:main")]
    }
    assert shown == {
        "script": "train.py a=1",
        "module": "-m pkg.train a=1",
        "entrypoint": "pkg.train:main a=1",
    }
    assert runner_for(DRY_RUN_TARGET).describe(DRY_RUN_TARGET).startswith("dry run (rendezvous check")
    assert (
        runner_for(GROUP_TARGET).describe(GROUP_TARGET) == "rank group (functions called from this process)"
    )
    assert set(RUNNERS) == set(type(DRY_RUN_TARGET.kind))  # every kind has its runner


def test_missing_targets_are_caught_in_the_driver(tmp_path):
    (tmp_path / "mod.py").write_text("def present():\n    pass\nalias = present\n")
    check_target_locally(Target("entrypoint", "mod:present"), str(tmp_path))
    check_target_locally(Target("entrypoint", "mod:alias"), str(tmp_path))
    with pytest.raises(UsageError, match="defines no absent"):
        check_target_locally(Target("entrypoint", "mod:absent"), str(tmp_path))
    with pytest.raises(UsageError, match="no module named nosuchmod"):
        check_target_locally(Target("entrypoint", "nosuchmod:f"), str(tmp_path))
    with pytest.raises(UsageError, match=r"script nope\.py not found"):
        check_target_locally(Target("script", "nope.py"), str(tmp_path))
    dry = Target(DRY_RUN_TARGET.kind, DRY_RUN_TARGET.name, ("data=d/corpus",))
    with pytest.raises(UsageError, match=r"--dry-run data=d/corpus: no d/corpus\.bin and \.idx"):
        check_target_locally(dry, str(tmp_path))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "corpus.bin").write_bytes(b"")
    (tmp_path / "d" / "corpus.idx").write_bytes(b"")
    check_target_locally(dry, str(tmp_path))  # relative to the launch's working directory, as ranks read it


def test_a_folder_as_script_or_as_state_dir_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "adir").mkdir()
    assert main(["--device", "cpu", "adir"]) == 2
    assert "script adir is a folder, not a Python file" in capsys.readouterr().err
    (tmp_path / "afile").write_text("")
    monkeypatch.setenv("MEGARAY_STATE_DIR", str(tmp_path / "afile"))
    for argv in (["list"], ["down"], ["up"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert (
            f"MEGARAY_STATE_DIR names {tmp_path / 'afile'}, which is not a folder" in err
            and err.count("\n") == 1
        )


def test_missing_script_exits_2_before_any_ray(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["--nodes", "1", "missing.py"]) == 2
    assert "script missing.py not found" in capsys.readouterr().err


def test_help_names_every_command_with_one_line_each(capsys):
    from launcher.cli.commands import COMMANDS
    from launcher.cli.main import main as cli_main

    with pytest.raises(SystemExit) as done:
        cli_main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    listed = out[out.index("commands (megaray COMMAND --help for each):") :].splitlines()[1:]
    names = [ln.split()[0] for ln in listed if ln.startswith("  ") and ln.strip()]
    assert names == ["up", "down", "list", "submit", "status", "logs", "stop", "recipes", "doctor"]
    assert set(names) == set(COMMANDS)
    for name in names:  # each command answers --help itself
        with pytest.raises(SystemExit) as sub:
            cli_main([name, "--help"])
        assert sub.value.code == 0, name


def test_what_follows_a_module_is_the_modules_as_under_python_and_torchrun():
    spec = spec_from_args(["--nodes", "2", "-m", "pkg.train", "--lr", "1", "--nodes", "3"])
    assert spec.nodes == 2 and spec.target.name == "pkg.train"
    assert spec.target.args == ("--lr", "1", "--nodes", "3")  # torchrun -m pkg.train --nnodes 3: the module's
    assert spec_from_args(["-m", "pkg.train", "--", "--lr", "1"]).target.args == (
        "--lr",
        "1",
    )  # `--` as before
    for argv in (["-m"], ["-m", "--lr", "1"]):
        with pytest.raises(UsageError, match="-m needs a module name"):
            spec_from_args(argv)


def test_dry_run_switches_take_megatron_bridges_words_for_yes_and_no():
    from launcher.core.target import parse_dry_run_options

    for word, value in (("true", True), ("1", True), ("On", True), ("false", False), ("0", False)):
        assert parse_dry_run_options([f"exit_signal_handler={word}"]) == {"exit_signal_handler": value}


def test_the_help_lists_every_dry_run_option():
    from launcher.core.launch_args import build_parser
    from launcher.core.target import DRY_RUN_OPTIONS

    text = " ".join(build_parser().format_help().split())
    assert all(f"{key}=" in text for key in DRY_RUN_OPTIONS), text
