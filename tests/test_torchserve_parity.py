"""TorchServe 0.12 and serve-repo's TorchServe front, call by call: the table of tests/parity_table.py replayed in
order on both, on copies of the same model store; status codes, headers and bodies compared (bodies byte for byte where
TorchServe's are deterministic, keys and value types otherwise); every intended difference is listed in
docs/migrating.md."""
from __future__ import annotations

import json
import re
import shutil
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from parity_table import ROWS
from perf import torchserve
from perf.serve import TorchServeFront
from support import ROOT
from test_handler import _archive

# expl.mar's handler: TorchServe's BaseHandler with a deterministic explain_handle (each value doubled)
EXPLAINED_HANDLER = '''
import json
from ts.torch_handler.base_handler import BaseHandler


class Explained(BaseHandler):
    def initialize(self, context):
        self.initialized = True

    def preprocess(self, data):
        rows = [row.get("data") or row.get("body") for row in data]
        return [json.loads(row) if isinstance(row, (bytes, bytearray)) else row for row in rows]

    def inference(self, rows):
        return [{"sum": sum(row["values"])} for row in rows]

    def postprocess(self, answers):
        return answers

    def explain_handle(self, rows, raw_data):
        return [{"weights": [value * 2 for value in row["values"]]} for row in rows]
'''

PHOTO = ROOT / "clients" / "samples" / "chelsea.jpg"
PROBABILITIES_CLOSE = 1e-4  # ours on OpenVINO fp32, TorchServe's eager: within 1e-5 of the logits' range
ATTRIBUTIONS_CLOSE = 1e-4  # of the largest attribution: both run eager PyTorch, threads may sum in another order
BODIES = {"photo": PHOTO.read_bytes(), "empty": b"", "text": b"hello"}


# The headers compared on every row: TorchServe's own four (x-request-id a new UUID each time), the content type (none
# on a handler's answer that set none), and the two a Python server adds and TorchServe does not (server, date).
COMPARED_HEADERS = ("content-type", "x-request-id", "pragma", "cache-control", "expires", "server", "date")
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def headers_of(message) -> tuple:
    """The compared headers an answer carries, (name, value) in COMPARED_HEADERS' order; values that differ by
    nature (the request id, the date) by their form."""
    found = []
    for name in COMPARED_HEADERS:
        value = message.get(name)
        if value is not None:
            found.append((name, "a UUID" if name == "x-request-id" and UUID.fullmatch(value) else
                          "a date" if name == "date" else value))
    return tuple(found)


def send(method: str, url: str, body: str | None) -> tuple[int, bytes, tuple]:
    """A row's call (a named binary body, or the row's text as JSON): (status, body, headers_of its answer)."""
    data, headers = None, {}
    if body in BODIES:  # urllib's default for a body is a form's content type, which TorchServe tries to parse
        data, headers = BODIES[body], {"Content-Type": "application/octet-stream"}
    elif body is not None:
        data, headers = body.encode(), {"Content-Type": "application/json"}
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=300) as reply:
            return reply.status, reply.read(), headers_of(reply.headers)
    except urllib.error.HTTPError as error:
        return error.code, error.read(), headers_of(error.headers)


def wait_ready(url: str, timeout: float = 300) -> None:
    """The model's workers all READY (a registration or scale answered 202 goes on in the background)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, body, _ = send("GET", url, None)
        if status == 200:
            described = json.loads(body)[0]
            workers = described["workers"]
            if len(workers) == described["minWorkers"] and all(w["status"] == "READY" for w in workers):
                return
        time.sleep(0.5)
    raise AssertionError(f"{url}: workers not READY after {timeout} s")


def replay(inference: str, management: str, outside: Path) -> list[tuple]:
    answers = []
    for method, path, body, compare in ROWS:
        url = (inference if path.startswith("i:") else management) + path[2:].replace("{outside}", str(outside))
        if compare == "wait":
            wait_ready(url)
            answers.append((0, b"", ()))
        else:
            answers.append(send(method, url, body))
    return answers


def shape(value):
    """Keys and value types, not values (timestamps, pids, probabilities, memory)."""
    if isinstance(value, dict):
        return {key: shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [shape(item) for item in value[:1]]  # a list's length (e.g. workers starting) is timing
    return type(value).__name__


def described_apart(mine: dict, reference: dict) -> str | None:
    """Where our OpenAPI document is not TorchServe's or fewer: its version and top-level keys, then per path the
    methods, each operation's keys (TorchServe's; "deprecated" where TorchServe's is) and its parameters' names.
    Paths TorchServe does not list are our explanation paths alone (TorchServe serves them, undocumented)."""
    if mine.get("openapi") != reference.get("openapi") or shape(mine)["info"] != shape(reference)["info"] or \
            set(mine) != set(reference):
        return "openapi version, info or top-level keys"
    # A model's description (TorchServe's title "RESTful API for: NAME"): TorchServe's names /prediction/NAME, which it
    # does not serve, and KServe's paths with an undeclared {model_name}; ours name NAME (docs/migrating.md)
    model = reference["info"].get("title", "").partition("RESTful API for: ")[2]
    theirs = {path.replace("/prediction/", "/predictions/", 1).replace("{model_name}", model) if model else path:
              operations for path, operations in reference["paths"].items()}
    for path, operations in mine["paths"].items():
        if path not in theirs:
            if not path.startswith("/explanations/") and not path.endswith("explain"):
                return f"{path}: not in TorchServe's"
            continue
        for method, operation in operations.items():
            if method not in theirs[path]:
                return f"{method} {path}: not in TorchServe's"
            reference_operation = theirs[path][method]
            if set(operation) - set(reference_operation):
                return f"{method} {path}: keys {sorted(set(operation) - set(reference_operation))}"
            names = {param["name"] for param in reference_operation.get("parameters", [])}
            if extra := {param["name"] for param in operation.get("parameters", [])} - names:
                return f"{method} {path}: parameters {sorted(extra)}"
    return None


def different(compare: str, ours: tuple, theirs: tuple) -> str | None:
    """Why `ours` is not `theirs` under `compare`; None: the same."""
    if compare == "wait":
        return None
    if ours[0] != theirs[0]:
        return f"status {ours[0]} != {theirs[0]}"
    if ours[2] != theirs[2]:
        return f"headers {ours[2]} != {theirs[2]}"
    if compare == "openapi":
        return described_apart(json.loads(ours[1]), json.loads(theirs[1]))
    if compare == "workers":
        def counts(body: bytes) -> list:
            return [(entry["minWorkers"], entry["maxWorkers"], len(entry["workers"])) for entry in json.loads(body)]
        return None if counts(ours[1]) == counts(theirs[1]) else f"workers {counts(ours[1])} != {counts(theirs[1])}"
    if compare == "bytes" and ours[1] != theirs[1]:
        return "body"
    if compare == "attributions":  # captum's: the same computation, on the same weights and photo
        mine, reference = (np.asarray(json.loads(body), dtype=np.float64) for body in (ours[1], theirs[1]))
        if mine.shape != reference.shape:
            return f"attributions of shape {mine.shape}, TorchServe's {reference.shape}"
        gap, largest = float(np.abs(mine - reference).max()), float(np.abs(reference).max())
        return None if gap <= ATTRIBUTIONS_CLOSE * largest else f"attributions {gap:.3g} apart (largest {largest:.3g})"
    if compare == "probabilities":  # an image classifier's top 5: the same engine's arithmetic within float noise
        mine, reference = json.loads(ours[1]), json.loads(theirs[1])
        if list(mine) != list(reference):
            return f"classes {list(mine)} != {list(reference)}"
        gap = max(abs(mine[name] - reference[name]) for name in reference)
        return None if gap <= PROBABILITIES_CLOSE else f"probabilities {gap:.3g} apart"
    if compare == "json":
        mine, reference = json.loads(ours[1] or b"null"), json.loads(theirs[1] or b"null")
        if shape(mine) != shape(reference):
            return "keys or types"
        if isinstance(reference, dict) and set(reference) <= {"code", "type", "message"} and mine != reference:
            return "error"
    return None


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """r18 1.0 and 2.0 (r18-v2.mar) and other 1.0: small resnet18 archives; junk.mar is none; expl.mar a custom
handler's, with explanations."""
    folder = tmp_path_factory.mktemp("parity") / "model_store"
    for name, version, file in (("r18", "1.0", "r18"), ("r18", "2.0", "r18-v2"), ("other", "1.0", "other")):
        made = torchserve.resnet_archive(folder / file, name, None, None, None, arch="resnet18", fc_scale=0.01,
                                         version=version)
        made.rename(folder / f"{file}.mar")
        shutil.rmtree(made.parent)
    scripted = torchserve.resnet_archive(folder / "r18s", "r18s", None, None, None, arch="resnet18", fc_scale=0.01,
                                         scripted=True)
    scripted.rename(folder / "r18s.mar")
    shutil.rmtree(scripted.parent)
    (folder / "junk.mar").write_text("hello\n")
    _archive(folder.parent / "expl", "expl", EXPLAINED_HANDLER).rename(folder / "expl.mar")
    (folder.parent / "outside").mkdir()  # issue 52: archives from outside the store, by file:// URLs
    for name in ("r18.mar", "away.mar"):
        shutil.copy(folder / "other.mar", folder.parent / "outside" / name)
    return folder


def copy_of(store: Path, to: Path) -> Path:
    shutil.copytree(store, to)
    return to


def theirs(store: Path, folder: Path) -> list[tuple]:
    copied = copy_of(store, folder / "model_store")
    with torchserve.started(folder, copied / "r18.mar", workers=1, properties={"enable_model_api": "true"}) as real:
        return replay(real.inference_url, real.management_url, store.parent / "outside")


def ours(store: Path, folder: Path) -> list[tuple]:
    copied = copy_of(store, folder / "model_store")
    front = TorchServeFront(folder / "front", "--trust-model-code", model_store=str(copied),
                            load_models="r18=r18.mar", enable_model_api="true", disable_token_authorization="true",
                            default_workers_per_model="1", max_workers_per_model="2")
    try:
        return replay(front.inference_url, front.management_url, store.parent / "outside")
    finally:
        front.stop()


@pytest.fixture(scope="module")
def answers(store, tmp_path_factory) -> tuple[list, list]:
    """(ours, TorchServe's): the two replays side by side (each waits on its workers and builds much of the time)."""
    with ThreadPoolExecutor(1) as pool:
        reference = pool.submit(theirs, store, tmp_path_factory.mktemp("torchserve"))
        mine = ours(store, tmp_path_factory.mktemp("front"))
        return mine, reference.result()


def test_the_table_holds_150_calls_on_every_endpoint():
    assert len(ROWS) >= 150
    endpoints = {(method, path.split("?")[0].split("/")[1]) for method, path, _, _ in ROWS}
    for needed in (("GET", "ping"), ("POST", "predictions"), ("PUT", "predictions"), ("GET", "models"),
                   ("POST", "models"), ("PUT", "models"), ("DELETE", "models")):
        assert needed in endpoints


def test_each_call_answers_as_torchserve_or_its_difference_is_listed(answers):
    ours, theirs = answers
    listed = (ROOT / "docs" / "migrating.md").read_text()
    found = []
    for row, mine, reference in zip(ROWS, ours, theirs):
        method, path, _, compare = row
        if compare.startswith("differs: "):
            assert compare.removeprefix("differs: ") in listed, row
            continue
        if (why := different(compare, mine, reference)) is not None:
            found.append(f"{method} {path}: {why}\n  ours:   {mine[0]} {mine[1][:300]!r}\n"
                         f"  theirs: {reference[0]} {reference[1][:300]!r}")
    assert not found, f"{len(found)} differences:\n" + "\n".join(found)
