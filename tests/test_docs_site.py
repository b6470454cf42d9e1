"""The documentation site builds in strict mode, its links hold, and strict mode really fails on a broken one."""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from builder.cli import parser as build_parser
from server.cli import parser as serve_parser
from support import ROOT

pytest.importorskip("sphinx", reason="the docs tools come with the test extra (pip install -e '.[test]')")
pytest.importorskip("myst_parser")
pytest.importorskip("sphinxarg")
DOCS = ROOT / "docs"
# The same command as `make docs`: -W turns every warning into an error, -n reports every unresolved reference.
STRICT = ["-W", "--keep-going", "-n", "-b", "html", "-q"]


def _sphinx(source: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sphinx", *STRICT, str(source), str(out)],
                          capture_output=True, text=True, timeout=300)


def _readable_dir(prefix: str) -> Path:
    """A folder everyone may read: run as root, linkchecker drops to user nobody, who cannot enter pytest's
    0700 tmp_path (every link would then fail for that reason, not for a broken link)."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    folder.chmod(0o755)
    return folder


def _linkchecker(page: Path) -> subprocess.CompletedProcess:
    """linkchecker over the built HTML, internal links only (it checks no external URL unless asked)."""
    exe = Path(sys.executable).with_name("linkchecker")
    command = [str(exe)] if exe.exists() else [shutil.which("linkchecker") or "linkchecker"]
    return subprocess.run([*command, "--no-status", "--no-robots", str(page)],
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def site():
    out = _readable_dir("docs-site-")
    try:
        built = _sphinx(DOCS, out)
        assert built.returncode == 0, f"strict build failed:\n{built.stdout}\n{built.stderr}"
        yield out
    finally:
        shutil.rmtree(out)


def test_docs_site_builds_in_strict_mode_when_every_page_is_listed(site):
    pages = {p.stem for p in DOCS.glob("*.md")}
    assert pages <= {p.stem for p in site.glob("*.html")}
    assert (site / "_images" / "cpu-engines-amd-epyc.png").exists()


@pytest.mark.parametrize(("page", "make"), [("build-repo", build_parser), ("serve-repo", serve_parser)])
def test_docs_site_reference_names_every_flag_of_the_parser_when_built(site, page, make):
    """The references are rendered from argparse: every option string the parser has is on its page."""
    html = (site / f"{page}.html").read_text()
    missing = [flag for action in make()._actions if not isinstance(action, argparse._HelpAction)
               for flag in action.option_strings if flag not in html]
    assert not missing, f"{page}.html lacks {missing}"


def test_docs_site_has_no_broken_link_when_linkchecker_reads_it(site):
    checked = _linkchecker(site / "index.html")
    assert checked.returncode == 0, f"linkchecker found broken links:\n{checked.stdout}\n{checked.stderr}"
    links = re.search(r"(\d+) links? in \d+ URLs? checked", checked.stdout)
    assert links and int(links.group(1)) > 20, f"linkchecker followed too few links:\n{checked.stdout}"


def test_linkchecker_reports_a_broken_link_when_a_page_points_at_nothing():
    folder = _readable_dir("docs-broken-")
    try:
        (folder / "index.html").write_text('<html><body><a href="missing.html">gone</a></body></html>')
        (folder / "index.html").chmod(0o644)
        checked = _linkchecker(folder / "index.html")
    finally:
        shutil.rmtree(folder)
    assert checked.returncode != 0
    assert "missing.html" in checked.stdout and "1 error" in checked.stdout, checked.stdout


def test_strict_build_fails_when_a_page_links_to_a_missing_page(tmp_path):
    source = tmp_path / "docs"
    shutil.copytree(DOCS, source, ignore=shutil.ignore_patterns("_build"))
    with (source / "getting-started.md").open("a") as page:
        page.write("\nSee [a page that does not exist](no-such-page.md).\n")
    built = _sphinx(source, tmp_path / "html")
    assert built.returncode != 0
    assert "no-such-page" in built.stderr
