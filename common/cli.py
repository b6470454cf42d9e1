"""The argument parser every command shares: a bad argument is one line on stderr and status 2."""
from __future__ import annotations

import argparse


class OneLineParser(argparse.ArgumentParser):
    """argparse, but an error is one line, and the description (a module docstring) keeps its layout."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):  # argparse would print the whole usage first
        self.exit(2, f"{self.prog}: error: {message}\n")
