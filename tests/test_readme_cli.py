"""What README.md and the site's pages say about the commands is what the commands do: flags exist.

The build-repo and serve-repo references are rendered from their argparse definitions (docs/build-repo.md
and docs/serve-repo.md, by sphinx-argparse), so a flag's meaning and default are written once, in its help.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import re

import pytest

from builder.cli import parser as build_parser
from server.cli import parser as serve_parser
from support import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# A command as the docs write it, in a code block or inline code: its name, then its arguments.
COMMAND = re.compile(r"(?<![\w/.-])(build-repo|serve-repo|python -m ([a-z_]+(?:\.[a-z_]+)+))((?:[ \t]+[^\s`|#]+)*)")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
DEFAULT = re.compile(r"Default:\s*\S")


def _parsers() -> dict[str, argparse.ArgumentParser]:
    return {"build-repo": build_parser(), "serve-repo": serve_parser()}


def _options(p: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in p._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def _code(text: str) -> list[str]:
    """A document's code: fenced and indented blocks (continuation lines joined) and inline spans."""
    blocks = re.findall(r"^```.*?^```", text, flags=re.S | re.M)
    indented = re.findall(r"^(?: {4}.*\n?)+", text, flags=re.M)
    spans = re.findall(r"`([^`\n]+)`", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M))
    return [block.replace("\\\n", " ") for block in blocks + indented] + spans


def _commands(text: str) -> list[tuple[str, list[str]]]:
    """(command, flags given to it) for every command line a document shows."""
    found = []
    for code in _code(text):
        for line in code.splitlines():
            for match in COMMAND.finditer(line):
                arguments = match.group(3).split(" -- ")[0]  # after a bare --: tritonserver's own flags
                found.append((match.group(2) or match.group(1), FLAG.findall(arguments)))
    return found


def _help(module: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exited:
        importlib.import_module(module).main(["--help"])
    assert exited.value.code == 0, f"python -m {module} --help exited {exited.value.code}"
    return out.getvalue()


def test_cli_help_strings_name_a_default_for_every_flag_when_rendered():
    """The references show each help string as written: its 'Default: X.' is the one place a default lives."""
    missing = [f"{name} {action.option_strings[0]}" for name, p in _parsers().items()
               for action in _options(p) if not DEFAULT.search(action.help or "")]
    assert not missing, f"help strings without 'Default: X.': {missing}"


def test_docs_hold_no_hand_written_flag_tables_when_read():
    """Flags and defaults are rendered by sphinx-argparse, not copied into a table by hand or by a script."""
    tables = [doc.relative_to(ROOT).as_posix() for doc in DOCS if re.search(r"<!-- cli:|^\| option \|", doc.read_text(), re.M)]
    assert not tables, f"hand-kept flag tables in {tables}"
    for page, module in (("build-repo.md", "builder.cli"), ("serve-repo.md", "server.cli")):
        assert f":module: {module}" in (ROOT / "docs" / page).read_text(), f"docs/{page} does not render {module}"


def test_docs_commands_exist_with_the_flags_they_give_them_when_run_with_help():
    commands = [(doc.relative_to(ROOT).as_posix(), name, flags) for doc in DOCS for name, flags in _commands(doc.read_text())]
    shown = {name for _, name, _ in commands}
    assert {"build-repo", "serve-repo", "clients.classify"} <= shown
    assert {doc for doc, _, _ in commands} >= {"README.md", "docs/getting-started.md", "docs/performance.md"}
    known = {name: {flag for action in _options(p) for flag in action.option_strings} for name, p in _parsers().items()}
    wrong = []
    for doc, name, flags in commands:
        if name not in known:
            assert importlib.util.find_spec(name) is not None, f"{doc}: python -m {name}: no such module"
            known[name] = set(FLAG.findall(_help(name)))
        wrong += [f"{doc}: {name} {flag}" for flag in flags if flag not in known[name]]
    assert not wrong, "flags the docs give that the command does not take:\n" + "\n".join(sorted(set(wrong)))


def test_docs_commands_check_catches_a_flag_that_does_not_exist_when_one_is_made_up():
    text = "    build-repo --model resnet18 --no-such-flag 3\n    python -m clients.classify x.jpg --top-k 5\n"
    assert _commands(text) == [("build-repo", ["--model", "--no-such-flag"]), ("clients.classify", ["--top-k"])]
