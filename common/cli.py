"""The argument parser every command shares: a bad argument is one line on stderr and status 2."""
from __future__ import annotations

import argparse


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print the whole usage first
        self.exit(2, f"{self.prog}: error: {message}\n")
