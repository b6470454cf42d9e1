"""What every command shares: the argument parser (a bad argument is one line on stderr and status 2) and the
writing of a command's JSON result."""
from __future__ import annotations

import argparse
import json
from pathlib import Path


class OneLineParser(argparse.ArgumentParser):
    """argparse, but an error is one line, and the description (a module docstring) keeps its layout."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):  # argparse would print the whole usage first
        self.exit(2, f"{self.prog}: error: {message}\n")


def write_result(result: dict, out: Path | None) -> str:
    """`result` as indented JSON, also written to `out` (its folder made) when one is given."""
    text = json.dumps(result, indent=1)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    return text
