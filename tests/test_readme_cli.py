"""What the README says about the commands is what the commands do: flags exist, defaults are the CLI's."""
from __future__ import annotations

import contextlib
import importlib
import io
import re

import pytest

from support import ROOT
from tools import cli_tables

README = (ROOT / "README.md").read_text()
# A command as the README writes it, in a code block or inline code: its name, then its arguments.
COMMAND = re.compile(r"(?<![\w/.-])(build-repo|serve-repo|python -m ([a-z_]+(?:\.[a-z_]+)+))((?:[ \t]+[^\s`|#]+)*)")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def _code() -> list[str]:
    """The README's code: fenced and indented blocks (continuation lines joined) and inline spans."""
    blocks = re.findall(r"^```.*?^```", README, flags=re.S | re.M)
    indented = re.findall(r"^(?: {4}.*\n?)+", README, flags=re.M)
    spans = re.findall(r"`([^`\n]+)`", re.sub(r"^```.*?^```", "", README, flags=re.S | re.M))
    return [block.replace("\\\n", " ") for block in blocks + indented] + spans


def _commands() -> list[tuple[str, list[str]]]:
    """(command, flags given to it) for every command line the README shows."""
    found = []
    for text in _code():
        for line in text.splitlines():
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


def test_readme_flag_tables_are_rendered_from_the_parsers_when_read():
    """Each flag of build-repo and serve-repo, its meaning and its default: once, in the code."""
    assert cli_tables.render(README) == README, "README.md's flag tables are stale: run python -m tools.cli_tables"


def test_readme_flag_tables_name_a_default_for_every_flag_when_rendered():
    missing = [f"{name} {action.option_strings[0]}" for name, p in cli_tables.parsers().items()
               for action in cli_tables.options(p) if not cli_tables.split_help(action.help)[1]]
    assert not missing, f"help strings without 'Default: X.': {missing}"


def test_readme_commands_exist_with_the_flags_it_gives_them_when_run_with_help():
    commands = _commands()
    assert {"build-repo", "serve-repo", "clients.classify"} <= {name for name, _ in commands}
    parsers = cli_tables.parsers()
    known = {name: {flag for action in cli_tables.options(p) for flag in action.option_strings}
             for name, p in parsers.items()}
    wrong = []
    for name, flags in commands:
        if name not in known:
            assert importlib.util.find_spec(name) is not None, f"python -m {name}: no such module"
            known[name] = set(FLAG.findall(_help(name)))
        wrong += [f"{name} {flag}" for flag in flags if flag not in known[name]]
    assert not wrong, "flags the README gives that the command does not take:\n" + "\n".join(sorted(set(wrong)))


def test_readme_commands_check_catches_a_flag_that_does_not_exist_when_one_is_made_up():
    line = "    build-repo --model resnet18 --no-such-flag 3\n    python -m clients.classify x.jpg --top-k 5"
    found = [(m.group(2) or m.group(1), FLAG.findall(m.group(3))) for m in COMMAND.finditer(line)]
    assert found == [("build-repo", ["--model", "--no-such-flag"]), ("clients.classify", ["--top-k"])]
