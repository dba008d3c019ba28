"""The documentation, checked so that it cannot drift from what megaray does (#48): the site builds
with `mkdocs build --strict` (a broken link or page fails it), the command-line reference is what
the argument parsers make, every option is explained, and the README's commands are the ones CI
runs and ones megaray takes."""

from __future__ import annotations

import argparse
import os
import re
import shlex
from pathlib import Path

import pytest

from launcher.cli.commands import COMMANDS
from launcher.cli.jobspec import submit_spec_from_args
from launcher.cli.reference import markdown, options, parsers, undocumented
from launcher.core.launch_args import build_parser, spec_from_args

from .conftest import REPO, documented_fields, table_names

README = REPO / "README.md"


def test_the_site_builds_with_strict(tmp_path, monkeypatch):
    """In this process, as `mkdocs build --strict` does: any warning (a link to a page or an anchor
    that is not there, a page left out of the nav, a docstring mkdocstrings cannot read) fails."""
    pytest.importorskip("mkdocs", reason="the test extra installs MkDocs: pip install -e '.[test]'")
    from mkdocs.commands.build import build
    from mkdocs.config import load_config
    from mkdocs.exceptions import Abort

    monkeypatch.setenv("NO_MKDOCS_2_WARNING", "1")  # Material's notice about its successor
    monkeypatch.chdir(REPO)
    config = load_config(str(REPO / "mkdocs.yml"), strict=True, site_dir=str(tmp_path / "site"))
    try:
        build(config)
    except Abort as e:
        pytest.fail(f"mkdocs build --strict: {e}")
    assert (tmp_path / "site" / "reference" / "cli" / "index.html").exists()
    python_api = (tmp_path / "site" / "reference" / "python" / "index.html").read_text()
    assert "RankGroup" in python_api and "spec_from_args" in python_api  # from their docstrings


def test_the_cli_reference_is_what_the_parsers_make_and_explains_every_option():
    page = (REPO / "docs" / "reference" / "cli.md").read_text()
    assert page == markdown(), "run: python -m launcher.cli.reference > docs/reference/cli.md"
    assert {title: undocumented(p) for title, p, _ in parsers() if undocumented(p)} == {}
    assert [f"## `megaray {name}`" in page for name in COMMANDS] == [True] * len(COMMANDS)


def test_the_torchrun_guides_option_table_lists_every_launch_option_and_no_other():
    guide = (REPO / "docs" / "guides" / "torchrun.md").read_text()
    table = guide.split("| option | meaning |", 1)[1].split("\n\n", 1)[0]
    listed = {name.split()[0] for name in table_names(table) if name[0] == "-"}
    given = [a.option_strings for a in options(build_parser()) if a.option_strings]
    assert sorted(listed - {n for names in given for n in names}) == []  # no option that is gone
    assert [names for names in given if not set(names) & listed] == []  # none left out


def _commands(page: Path) -> list[list[str]]:
    """Every `megaray ...` and `python main.py ...` line in a page's code blocks, as argv (not the
    usage lines of ```text blocks, which show the syntax)."""
    commands, fence = [], None
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fence = None if fence is not None else line[3:].strip()
        elif fence not in (None, "text") and re.match(r"(\.venv/bin/)?megaray |python main\.py ", line):
            words = shlex.split(re.split(r"\s#\s", line)[0])
            if words[:1] in (["megaray"], [".venv/bin/megaray"]):
                commands.append(words[1:])
            elif words[:2] == ["python", "main.py"]:
                commands.append(words[2:])
    return commands


def test_the_readmes_commands_are_what_ci_runs_and_every_command_shown_is_one_megaray_takes(
    tmp_path, monkeypatch
):
    readme = README.read_text()
    assert len(readme.splitlines()) <= 200, "the README stays short: the rest goes in docs/"
    ci = [ln for ln in (REPO / ".ci" / "run").read_text().splitlines() if ln.startswith("python -m venv")]
    assert len(ci) == 2 and all(f"\n{line}\n" in readme for line in ci), ci  # the demo, the tests
    (tmp_path / "train.py").write_text("")
    monkeypatch.chdir(tmp_path)  # `--working-dir .`: a submitted script must be in it
    pages = [README, *sorted((REPO / "docs").rglob("*.md"))]
    commands = [argv for page in pages for argv in _commands(page)]
    assert len(commands) >= 40 and len(_commands(README)) >= 10
    for argv in commands:
        if argv and argv[0] == "submit":
            submit_spec_from_args(argv[1:], environ={})
        elif argv and argv[0] in COMMANDS:
            parser = COMMANDS[argv[0]].parser(argv[0])
            assert isinstance(parser.parse_args(argv[1:]), argparse.Namespace)
        else:
            spec_from_args(argv, environ={"PATH": os.environ.get("PATH", "")})


def test_the_run_directory_reference_lists_the_fields():
    assert {"status", "exit_code", "root_cause", "failures", "goodput", "duration_s"} <= documented_fields(
        "summary.json"
    )
    assert {"master_addr", "master_port", "ranks", "nodes"} == documented_fields("topology.json")
