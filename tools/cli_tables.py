"""The README's flag tables of build-repo and serve-repo, rendered from their argparse definitions.

    python -m tools.cli_tables            # rewrite the tables in README.md (between the cli: markers)
    python -m tools.cli_tables --check    # exit 1 if README.md differs from what the parsers say

Each help string ends with "Default: X." (STYLE.md): the table's default column is that X, so a default
is stated once, in the code. tests/test_readme_cli.py runs the check.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
_DEFAULT = re.compile(r"\s*Default:\s*(.*?)\.?\s*$", re.S)


def parsers() -> dict[str, argparse.ArgumentParser]:
    from builder.cli import parser as build_parser
    from server.cli import parser as serve_parser

    return {"build-repo": build_parser(), "serve-repo": serve_parser()}


def split_help(text: str) -> tuple[str, str]:
    """(meaning, default) of a help string that ends with "Default: X."."""
    text = " ".join((text or "").split())
    match = _DEFAULT.search(text)
    if not match:
        return text, ""
    return text[:match.start()].strip(), match.group(1).strip()


def options(p: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in p._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def _flag(action: argparse.Action) -> str:
    if action.nargs == 0:
        return " / ".join(action.option_strings)
    value = "|".join(map(str, action.choices)) if action.choices else (action.metavar or action.dest.upper())
    if isinstance(value, tuple):
        value = " ".join(value)
    if action.nargs in ("+", "*"):
        value += " ..."
    return " / ".join(action.option_strings) + " " + value


def table(p: argparse.ArgumentParser) -> str:
    rows = ["| option | meaning | default |", "|---|---|---|"]
    for action in options(p):
        meaning, default = split_help(action.help)
        cells = [f"`{_flag(action)}`", meaning, default]
        rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(rows)


def render(text: str) -> str:
    """`text` with every table between <!-- cli:NAME --> and <!-- /cli:NAME --> rendered anew."""
    for name, p in parsers().items():
        pattern = re.compile(rf"(<!-- cli:{name} -->\n)(?:.*?\n)?(<!-- /cli:{name} -->)", re.S)
        if not pattern.search(text):
            raise SystemExit(f"README.md has no <!-- cli:{name} --> ... <!-- /cli:{name} --> block")
        text = pattern.sub(lambda m, p=p: m.group(1) + table(p) + "\n" + m.group(2), text)
    return text


def main(argv: list[str] | None = None) -> int:
    from common.cli import OneLineParser

    p = OneLineParser(prog="python -m tools.cli_tables", description=__doc__)
    p.add_argument("--check", action="store_true", help="only compare; exit 1 if they differ. Default: off.")
    args = p.parse_args(argv)
    current = README.read_text()
    wanted = render(current)
    if args.check:
        if wanted != current:
            print("README.md's flag tables differ from the parsers: run python -m tools.cli_tables", file=sys.stderr)
            return 1
        return 0
    README.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
