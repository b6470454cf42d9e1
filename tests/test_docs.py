"""The docs as a reader meets them: links and paths that resolve, results without machine paths, exact maps."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOT_OURS = {".git", ".venv", "build", "__pycache__", ".pytest_cache"}
RESULTS = ("perf/results", "drills/results")
# Where a run's machine leaves its mark: home folders, temp folders, this project's checkouts, system trees.
MACHINE_PATHS = (b"/root/", b"/tmp/", b"/home/", b"/work/", b"/Users/", b"/usr/", b"/opt/", b"/mnt/")
# Rooms whose every module the full map (docs/contributing.md) must name.
# Flags the docs give for another tool's command that nothing here runs (docker/README.md: a plain `docker run`, and
# the podman flag it tried that cannot work on this machine).
OTHER_TOOLS_FLAGS = {"--health-cmd", "--cgroups"}
ROOMS = ("common", "builder", "server", "backends", "clients", "perf", "drills", "examples", "tools")


def _files() -> list[Path]:
    """The repository's files: git's list where there is a checkout, else the tree minus what is not ours."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
        return [ROOT / name for name in out.decode().split("\0") if name and (ROOT / name).exists()]
    except (OSError, subprocess.CalledProcessError):
        return [p for p in ROOT.rglob("*") if p.is_file() and not NOT_OURS & set(p.relative_to(ROOT).parts)
                and not any(part.endswith(".egg-info") for part in p.parts)]


def _markdown() -> list[Path]:
    """Every Markdown file git knows, and the site's pages even before they are committed."""
    return sorted({p for p in _files() if p.suffix == ".md"} | set((ROOT / "docs").glob("*.md")))


def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code, where brackets are code, not links."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def _relative_targets(text: str) -> list[str]:
    prose = _prose(text)
    targets = re.findall(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", prose)
    targets += re.findall(r"^\s*\[[^\]\n]+\]:\s*<?(\S+?)>?(?:\s|$)", prose, flags=re.M)
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.I) and not t.startswith("#")]


def test_markdown_links_resolve_when_the_docs_are_read():
    broken = []
    for md in _markdown():
        for target in _relative_targets(md.read_text()):
            path = target.split("#", 1)[0]
            if path and not (md.parent / path).exists():
                broken.append(f"{md.relative_to(ROOT)}: {target}")
    assert not broken, "links to nothing:\n" + "\n".join(broken)


def test_repository_paths_in_inline_code_exist_when_the_docs_are_read():
    """`perf/results/x.json`-style mentions are links a reader follows by hand: they must exist too.
    CHANGELOG.md is history and names paths of its time."""
    tops = {p.relative_to(ROOT).parts[0] for p in _files() if len(p.relative_to(ROOT).parts) > 1}
    tops.discard("model_repository")  # its model folders are generated, never committed
    generated = ("docs/_build",)  # make docs writes the site there; git ignores it
    missing = []
    for md in [md for md in _markdown() if md.name != "CHANGELOG.md"]:
        for span in re.findall(r"`([^`\s]+)`", md.read_text()):
            path = span.split("::", 1)[0].rstrip(":,.")
            if "/" not in path or path.split("/", 1)[0] not in tops or not re.search(r"\.\w+$|/$|\*", path) \
                    or path.startswith(generated):
                continue
            if not list(ROOT.glob(path.rstrip("/"))):
                missing.append(f"{md.relative_to(ROOT)}: {span}")
    assert not missing, "paths that do not exist:\n" + "\n".join(missing)


@pytest.mark.parametrize("folder", RESULTS)
def test_results_carry_no_machine_path_when_committed(folder):
    found = [f"{p.relative_to(ROOT)}: {marker.decode()}" for p in _files()
             if p.relative_to(ROOT).as_posix().startswith(folder + "/")
             for marker in MACHINE_PATHS if marker in p.read_bytes()]
    assert not found, "machine paths in committed results:\n" + "\n".join(found)


def _map(doc: str) -> dict[str, set[str]]:
    """A document's map: top-level name -> the names listed under it (two-space indent, first word)."""
    section = re.search(r"^## The map\n(.*?)(?:^## |\Z)", (ROOT / doc).read_text(), flags=re.S | re.M)
    assert section, f"{doc} has a '## The map' section"
    entries: dict[str, set[str]] = {}
    current = None
    for line in section.group(1).splitlines():
        if not line.startswith("    ") or not line.strip() or line.strip()[0] in "│|":
            continue
        body = line[4:]
        indent = len(body) - len(body.lstrip())
        name = body.split()[0]
        if indent == 0:
            current = name
            entries[name] = set()
        elif indent == 2 and current:
            entries[current].add(name)
    return entries


def _top_folders() -> set[str]:
    return {p.relative_to(ROOT).parts[0] for p in _files()
            if len(p.relative_to(ROOT).parts) > 1 and not p.relative_to(ROOT).parts[0].startswith(".")}


def test_contributing_map_names_every_folder_and_module_when_read():
    entries = _map("docs/contributing.md")
    named = [top + child for top, children in entries.items() for child in [""] + sorted(children)]
    assert not [n for n in named if not (ROOT / n).exists()], "the map names what does not exist"
    assert _top_folders() <= {top.split("/")[0] for top in entries}, "top-level folders missing from the map"
    unnamed = [p.relative_to(ROOT).as_posix() for p in _files()
               if p.relative_to(ROOT).parts[0] in ROOMS and len(p.relative_to(ROOT).parts) == 2
               and p.suffix in (".py", ".sh") and p.name != "__init__.py"
               and p.name not in entries.get(p.relative_to(ROOT).parts[0] + "/", set())]
    assert not unnamed, f"modules the map does not name: {unnamed}"


def test_readme_short_map_names_every_top_level_folder_when_read():
    entries = _map("README.md")
    assert not [top for top in entries if not (ROOT / top).exists()], "the README's map names what does not exist"
    missing = _top_folders() - {top.split("/")[0] for top in entries}
    assert not missing, f"top-level folders missing from the README's map: {sorted(missing)}"


def _removed_scripts(line: str) -> str:
    """The text of the removed scripts a line names as `git show COMMIT:PATH` (a results README's row for a file
    whose script is gone), as of that commit: the command beside it is checked against the script that ran it."""
    shown = [subprocess.run(["git", "show", f"{commit}:{path}"], cwd=ROOT, capture_output=True).stdout
             for commit, path in re.findall(r"git show ([0-9a-f]{7,40}):([\w./-]+\.(?:py|sh))", line)]
    return b"\n".join(shown).decode(errors="replace")


def test_every_documented_flag_is_in_the_code_when_the_docs_are_read():
    """Issue 53: a flag the docs name (`--keep-snapshots`, a tritonserver flag serve-repo passes, a script's option)
    is in a parser, a script or a command line of the project: one that disappears from the code fails here. On a
    line naming a removed script (`git show COMMIT:PATH`), that script as of that commit counts as code too."""
    code = "\n".join(p.read_text(errors="replace") for p in _files()
                     if p.suffix in (".py", ".sh", ".yaml", ".toml") or p.name in ("Makefile", "Dockerfile"))
    named, missing = set(), set()
    for md in _markdown():
        for line in md.read_text().splitlines() if md.name != "CHANGELOG.md" else ():
            flags = {flag for span in re.findall(r"`([^`\n]+)`", line)
                     for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]+)", span)} - OTHER_TOOLS_FLAGS
            named |= flags
            where = code + _removed_scripts(line) if "git show" in line else code
            missing |= {flag for flag in flags if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", where)}
    missing = sorted(missing)
    assert len(named) > 50 and not missing, f"flags the docs name and the code lacks: {missing}"


def test_every_honoured_config_key_is_documented_and_every_documented_one_honoured_when_read():
    """Issue 53: docs/migrating.md's config.properties row and the keys serve-repo reads (properties.HONOURED) agree."""
    from server.torchserve.properties import HONOURED

    text = (ROOT / "docs" / "migrating.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `config.properties` |"))
    named = set(re.findall(r"`([a-z]+(?:_[a-z]+)+)`", row))
    assert named and named <= HONOURED, f"documented, not read: {sorted(named - HONOURED)}"
    assert not [key for key in HONOURED if f"`{key}" not in text], "read, not documented"
