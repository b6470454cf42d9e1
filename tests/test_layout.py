"""The layout by job holds: each room imports only what its place in the data path allows, modules stay short."""
import ast
import re
import subprocess

import pytest

from builder.repository import CLASSIFIER_FILES, FUSED_FILES, HANDLER_FILES, PREPROCESS_FILES
from support import ROOT

# Room -> the rooms it may import. The pipeline rooms (builder, server, backends) share only common/;
# clients/ may drive the pipeline (the demo builds, serves and classifies, as a user would); the rooms
# that measure, break and show may use anything but the tests.
PIPELINE = {"common", "builder", "server", "backends"}
ALLOWED = {
    "common": {"common"},
    "builder": {"common", "builder"},
    "server": {"common", "server"},
    "backends": {"common", "backends"},
    "clients": {"common", "builder", "server", "clients"},
    "perf": PIPELINE | {"clients", "perf"},
    "drills": PIPELINE | {"clients", "perf", "drills"},
    "examples": PIPELINE | {"clients", "examples"},
}
ROOMS = set(ALLOWED) | {"tests"}
# Inside a version folder the backends import their helpers by bare name (the folder is on sys.path).
BUNDLED = {name.removesuffix(".py") for name in {**CLASSIFIER_FILES, **PREPROCESS_FILES, **FUSED_FILES, **HANDLER_FILES}}
MAX_LINES = 350
# Issue 53: the benches and drills together (7,154 lines before it), kept by folding or removing one-off scripts whose
# question is answered (their results stay, the results READMEs name the commit to read them from).
MAX_MEASURE_LINES = 6000


def _modules(room: str) -> list:
    return sorted((ROOT / room).rglob("*.py"))


def _imported_rooms(path) -> set[str]:
    rooms = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
        rooms |= {name.split(".")[0] for name in names} & ROOMS
    return rooms


@pytest.mark.parametrize("room", sorted(ALLOWED))
def test_room_imports_only_the_rooms_below_it_when_its_modules_are_parsed(room):
    wrong = {str(path.relative_to(ROOT)): sorted(_imported_rooms(path) - ALLOWED[room]) for path in _modules(room)}
    assert not {path: rooms for path, rooms in wrong.items() if rooms}


def test_backends_import_their_helpers_by_bare_name_only_from_the_bundle_when_parsed():
    local = {path.stem for path in _modules("backends")} | {path.stem for path in _modules("common")}
    for path in _modules("backends"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in local:
                assert node.module in BUNDLED, f"{path.name} imports {node.module}, which build-repo does not copy"


@pytest.mark.parametrize("room", sorted(ALLOWED))
def test_modules_are_short_and_say_what_they_do_when_read(room):
    for path in _modules(room):
        text = path.read_text()
        assert len(text.splitlines()) <= MAX_LINES, f"{path.relative_to(ROOT)}: {len(text.splitlines())} lines"
        assert ast.get_docstring(ast.parse(text)), f"{path.relative_to(ROOT)} has no docstring"


def test_benches_and_drills_stay_within_their_line_budget_when_counted():
    counted = [path for room in ("perf", "drills") for path in _modules(room)]
    total = sum(len(path.read_text().splitlines()) for path in counted)
    assert len(counted) > 20 and total <= MAX_MEASURE_LINES, f"perf/ + drills/: {total} lines (at most {MAX_MEASURE_LINES})"

def test_no_script_kills_processes_by_pattern_when_the_tree_is_searched():
    """Kill by pid: killing by a name pattern also ends other people's servers on a shared machine."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    scripts = [ROOT / name for name in listed if name != "tests/test_layout.py" and (ROOT / name).is_file()
               and (name.endswith((".py", ".sh", ".yaml", ".yml")) or name.endswith("Makefile"))]
    # The two commands' names, assembled so that this file does not name them itself.
    pattern = re.compile(r"\b(" + "|".join(("p" + "kill", "kill" + "all")) + r")\b")
    assert scripts and not [str(p.relative_to(ROOT)) for p in scripts if pattern.search(p.read_text(errors="replace"))]


# What Python 3.11 added that a module here could reach for: pyproject says >= 3.10. tests/test_python_floor.py imports
# the modules that need no torch on a real 3.10; the ones that need torch never run on 3.10 here (its 3.10 build is
# several GB), so every module's grammar is checked by ast's feature_version and these names by search.
PY311 = re.compile(r"asyncio\.Runner|asyncio\.TaskGroup|asyncio\.timeout\(|\btomllib\b|\bExceptionGroup\b|"
                   r"typing\.Self|import Self\b|\bStrEnum\b|datetime\.UTC\b|\.add_note\(|hashlib\.file_digest")


@pytest.mark.parametrize("room", sorted(ALLOWED))
def test_modules_parse_and_import_as_python_3_10_does_when_read(room):
    assert 'requires-python = ">=3.10"' in (ROOT / "pyproject.toml").read_text()
    for path in _modules(room):
        text = path.read_text()
        ast.parse(text, filename=str(path), feature_version=(3, 10))
        found = PY311.search(text)
        assert found is None, f"{path.relative_to(ROOT)}: {found.group()} needs Python 3.11"


def _module_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports, at the top or inside a function (a deferred import is still an
    arrow: it only hides a circle from the interpreter until the function runs)."""
    names = {}
    for room in ALLOWED:
        for path in _modules(room):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            names[name.removesuffix(".__init__")] = path
    graph = {}
    for name, path in names.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        graph[name] = (found & set(names)) - {name}
    return graph


def test_modules_import_each_other_without_a_circle_when_every_import_is_followed():
    graph, state, path, circles = _module_graph(), {}, [], []

    def visit(module):
        state[module] = "open"
        path.append(module)
        for imported in sorted(graph[module]):
            if state.get(imported) == "open":
                circles.append(" -> ".join(path[path.index(imported):] + [imported]))
            elif imported not in state:
                visit(imported)
        path.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert len(graph) > 100 and graph["perf.gpu.served"]  # the house was read
    assert circles == []


def test_triton_model_suffixes_are_spelled_only_in_the_name_table_when_the_code_is_read():
    """Issue 53: the suffixes of a classifier's Triton models (NAME_image, NAME_preprocess, ...) were spelled out in
    four modules and ~20 f-strings; common/names.py is the one table, every other module asks it."""
    from common import names

    suffixes = "|".join(suffix.lstrip("_") for suffix in names.SUFFIXES.values() if suffix)
    spelled = re.compile(rf"""f["'][^"'\n]*\}}_({suffixes})\b|["']_({suffixes})["']""")
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
             for room in ROOMS - {"tests"} for path in _modules(room) if path.name != "names.py"
             for number, line in enumerate(path.read_text().splitlines(), 1) if spelled.search(line)]
    assert not found, "\n".join(found)


def test_every_build_the_front_starts_is_a_typed_request_that_build_repo_parses_back_when_read():
    """Issue 53: build-repo's command line for an archive is spelled in one place (BuildRequest.to_argv); the front's
    modules build no argv of their own, and build-repo's own parser reads back what the request holds."""
    from builder.cli import parser
    from common.build_request import BuildRequest

    request = BuildRequest(precision="fp32", engine="torch", trust_model_code=True, handler_path=True,
                           max_batch_size=4, max_batch_delay_ms=7, archive=ROOT / "a.mar", name="a_v1",
                           output=ROOT / "out")
    args = parser().parse_args(request.to_argv())
    assert (args.precision, args.engine, args.trust_model_code, args.handler_path, args.max_batch_size,
            args.max_queue_delay_us, args.from_mar, args.name, args.output, args.json) == \
        ("fp32", "torch", True, True, 4, 7000, ROOT / "a.mar", "a_v1", ROOT / "out", True)
    bare = parser().parse_args(BuildRequest(archive=ROOT / "a.mar", name="a", output=ROOT / "o").to_argv())
    assert (bare.precision, bare.engine, bare.trust_model_code, bare.handler_path) == (None, "auto", False, False)
    with pytest.raises(ValueError, match="archive"):
        BuildRequest(name="a").to_argv()
    flags = re.compile(r"""["']--(precision|engine|trust-model-code|handler-path|max-batch-size|max-batch-delay-ms|"""
                       r"""from-mar)["']""")
    found = [f"{path.relative_to(ROOT)}:{number}" for path in (ROOT / "server" / "torchserve").glob("*.py")
             for number, line in enumerate(path.read_text().splitlines(), 1) if flags.search(line)]
    assert not found, found
