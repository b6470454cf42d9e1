"""Sphinx configuration of the documentation site: Markdown pages (MyST), CLI references from argparse, furo."""
import sys
from pathlib import Path

# sphinx-argparse imports builder.cli and server.cli: the repository root must be importable.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

project = "Triton image classifier"
author = "the triton-classifier authors"
extensions = ["myst_parser", "sphinxarg.ext"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]
myst_heading_anchors = 3
html_theme = "furo"
html_title = "Triton image classifier"
# Inline code names repository files (tests/test_docs.py checks that they exist); nothing is auto-linked.
nitpicky = True
highlight_language = "none"  # the pages show shell lines and outputs in plain indented blocks
smartquotes = False  # "--flag" in help strings stays two hyphens, not an en dash
