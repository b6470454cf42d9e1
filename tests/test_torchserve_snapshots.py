"""TorchServe's config snapshots (issue 45): the same registrations, scale and set-default on TorchServe 0.12 and on
serve-repo's TorchServe front write the same model_snapshot; a restart with no config file restores what was
registered (models, versions, defaults, workers, batching) from the build cache, from our snapshot and from
TorchServe's own."""
from __future__ import annotations

import hashlib
import json
import re
import shutil
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from perf import torchserve
from perf.serve import TorchServeFront
from server import cli
from server.torchserve import run, snapshots
from server.torchserve.properties import PropertiesError, address, parse, settings
from support import ROOT

PHOTO = ROOT / "clients" / "samples" / "chelsea.jpg"
# The target: 3 models, one scaled to 2 workers (maxWorkers 3, kept apart), one with a second version set as
# default (its first version and the third model registered with 0 workers: nothing built, nothing loaded, and
# restored so; two builds, to keep the file short).
CALLS = [("POST", "/models?url=alpha.mar&initial_workers=0"),
         ("POST", "/models?url=alpha_v2.mar&initial_workers=1&synchronous=true"),
         ("PUT", "/models/alpha/2.0/set-default"),
         ("POST", "/models?url=alpha.mar&model_name=beta&initial_workers=1&batch_size=4&max_batch_delay=20"
                  "&synchronous=true"),
         ("PUT", "/models/beta?min_worker=2&max_worker=3&synchronous=true"),
         ("POST", "/models?url=alpha.mar&model_name=gamma&initial_workers=0"),
         # issue 52 F1: an archive from outside the store (copied into it, as TorchServe 0.12 copies it)
         ("POST", "/models?url=file://{outside}/delta.mar&model_name=delta&initial_workers=0"),
         # issue 52 F2: asynchronous with 0 workers (gRPC's default): it wrote no snapshot
         ("POST", "/models?url=alpha.mar&model_name=epsilon&initial_workers=0&synchronous=false")]
MODELS = ("alpha", "beta", "gamma", "delta", "epsilon")
# What TorchServe writes of itself (or of the keys of perf.torchserve's config.properties we do not give ours)
TORCHSERVE_ONLY_KEYS = {"number_of_gpu", "python", "version", "workflow_store", "install_py_dep_per_model"}
PROPERTIES = {"enable_model_api": "true", "disable_token_authorization": "true", "max_workers_per_model": "2"}


def call(method: str, url: str, data: bytes | None = None) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/octet-stream"} if data is not None else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, method=method, headers=headers),
                                    timeout=300) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def described(management_url: str) -> dict:
    """name -> (default version, {version: (minWorkers, maxWorkers, batchSize, maxBatchDelay, workers)})."""
    result = {}
    for name in MODELS:
        default = json.loads(call("GET", f"{management_url}/models/{name}")[1])[0]["modelVersion"]
        versions = json.loads(call("GET", f"{management_url}/models/{name}/all")[1])
        result[name] = (default, {v["modelVersion"]: (v["minWorkers"], v["maxWorkers"], v["batchSize"],
                                                      v["maxBatchDelay"], len(v["workers"])) for v in versions})
    return result


def make_calls(management_url: str, store: Path) -> None:
    for method, path in CALLS:
        status, body = call(method, management_url + path.format(outside=store.parent / "outside"))
        assert status == 200, (path, body)


def written(folder: Path) -> list[Path]:
    return sorted((folder / "logs" / "config").iterdir())


def model_snapshot(path: Path) -> dict:
    return json.loads(parse(path.read_text())["model_snapshot"])


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("snap") / "model_store"
    torchserve.resnet_archive(folder, "alpha", None, None, None, arch="resnet18", fc_scale=0.01, version="1.0")
    second = torchserve.resnet_archive(folder.parent / "v2", "alpha", None, None, None, arch="resnet18",
                                       fc_scale=0.01, version="2.0")
    shutil.copy(second, folder / "alpha_v2.mar")
    (folder.parent / "outside").mkdir()
    shutil.copy(folder / "alpha.mar", folder.parent / "outside" / "delta.mar")
    return folder


@pytest.fixture(scope="module")
def theirs(store):
    """TorchServe 0.12 with snapshots on: the calls made, described, stopped; its config folder."""
    folder = store.parent / "torchserve"
    with torchserve.started(folder, None, None, properties={"max_workers_per_model": "2", "enable_model_api": "true"},
                            store=store, snapshots=True) as real:
        make_calls(real.management_url, store)
        state = described(real.management_url)
    copied = (store / "delta.mar").read_bytes() == (store.parent / "outside" / "delta.mar").read_bytes()
    (store / "delta.mar").unlink()  # TorchServe's copy: ours makes its own
    return state, folder, copied


@pytest.fixture(scope="module")
def ours(store, theirs):
    """The TorchServe front: started, the same calls made, described, stopped (SIGTERM, as a process manager).
    After TorchServe's run: no port it takes is one ours gives back before its restart."""
    folder = store.parent / "ours"
    front = TorchServeFront(folder, model_store=str(store), **PROPERTIES)
    try:
        begun = time.monotonic()
        make_calls(front.management_url, store)
        calls_took = time.monotonic() - begun
        state = described(front.management_url)
    finally:
        front.stop()
    return state, front, calls_took


@pytest.fixture(scope="module")
def restarted(ours, store):
    """The front started again on the same folder with no config file (its newest snapshot is the configuration):
    how long to ready and to the first answer, what it describes, each model's answer; stopped."""
    _, before, _ = ours
    front = TorchServeFront(before.folder, "--model-store", str(store), config=False, ports=before.ports)
    try:
        first = call("POST", f"{front.inference_url}/predictions/alpha", PHOTO.read_bytes())[0]
        first_answer = time.monotonic() - front.started
        answers = {name: call("POST", f"{front.inference_url}/predictions/{name}", PHOTO.read_bytes())[0]
                   for name in (*MODELS, "alpha/1.0")}
        return front, described(front.management_url), first, answers, first_answer
    finally:
        front.stop()


def test_snapshots_are_written_at_start_after_each_change_and_at_stop_when_served(ours):
    _, front, _ = ours
    names = [path.name for path in written(front.folder)]
    kinds = [re.fullmatch(r"\d{17}-(startup|snapshot|shutdown)\.cfg", name).group(1) for name in names]
    assert kinds == ["startup"] + ["snapshot"] * len(CALLS) + ["shutdown"], names
    text = written(front.folder)[-1].read_text()
    assert text.startswith("#Saving snapshot\n#") and "model_snapshot={\\n  \"name\"\\: " in text


def test_our_snapshot_is_torchserves_for_the_same_calls_when_compared(ours, theirs):
    (_, front, _), (_, folder, _) = ours, theirs
    mine, its = written(front.folder)[-1], written(folder)[-1]
    assert its.name.endswith("-shutdown.cfg")
    mine_props, its_props = parse(mine.read_text()), parse(its.read_text())
    assert set(its_props) - set(mine_props) == TORCHSERVE_ONLY_KEYS and set(mine_props) <= set(its_props)
    for key in ("enable_model_api", "disable_token_authorization", "max_workers_per_model", "model_store"):
        assert mine_props[key] == its_props[key], key
    mine_snap, its_snap = model_snapshot(mine), model_snapshot(its)
    assert {k: type(v) for k, v in mine_snap.items()} == {k: type(v) for k, v in its_snap.items()}
    assert mine_snap["name"] == mine.name and mine_snap["modelCount"] == its_snap["modelCount"] == 6
    digests = {entry.pop("sha256") for versions in mine_snap["models"].values() for entry in versions.values()}
    assert digests == {hashlib.sha256((front.folder.parent / "model_store" / mar).read_bytes()).hexdigest()
                       for mar in ("alpha.mar", "alpha_v2.mar")}  # ours only: what a restore checks (issue 52)
    assert mine_snap["models"] == its_snap["models"]  # every field, value and type, as TorchServe wrote them


def test_described_state_is_torchserves_for_the_same_calls_when_compared(ours, theirs):
    assert ours[0] == theirs[0]
    assert ours[0]["alpha"] == ("2.0", {"1.0": (0, 0, 1, 100, 0), "2.0": (1, 1, 1, 100, 1)})
    assert ours[0]["delta"] == ours[0]["epsilon"] == ("1.0", {"1.0": (0, 0, 1, 100, 0)})
    assert ours[0]["beta"][1]["1.0"] == (2, 3, 4, 20, 2)


def test_restart_restores_every_registration_from_the_build_cache_when_no_config_is_given(ours, restarted):
    front, state, first, answers, first_answer = restarted
    assert front.seen("starting from the last snapshot") and not front.seen("building ")
    assert state == ours[0] and first == 200
    # 503: 0 workers, as registered
    assert answers == {"alpha": 200, "beta": 200, "gamma": 503, "delta": 503, "epsilon": 503, "alpha/1.0": 503}
    print(f"restart: ready in {front.took:.1f} s, first answer in {first_answer:.1f} s "
          f"(the first start: ready in {ours[1].took:.1f} s, its {len(CALLS)} calls {ours[2]:.1f} s)")


def test_each_change_is_in_a_snapshot_before_it_is_answered_when_made_over_rest(ours, theirs, store):
    """Issue 52 F2 and F1: the asynchronous registration with 0 workers is in the last snapshot written before the
    stop (it wrote none: a kill -9 lost it); the archive from outside the store is in the store, named by the snapshot,
    as TorchServe 0.12 copies it."""
    _, front, _ = ours
    files = written(front.folder)
    last = files[[path.name.endswith("-shutdown.cfg") for path in files].index(True) - 1]  # the first run's last
    before_stop = model_snapshot(last)["models"]
    assert last.name.endswith("-snapshot.cfg") and set(before_stop) == set(MODELS)
    assert before_stop["delta"]["1.0"]["marName"] == "delta.mar" and theirs[2]  # TorchServe's copy was the file
    assert (store / "delta.mar").read_bytes() == (store.parent / "outside" / "delta.mar").read_bytes()


def test_a_snapshot_written_by_torchserve_is_restored_as_it_described_when_started_from(theirs, store, ours):
    state, folder, _ = theirs
    target = store.parent / "from-torchserve"
    source = written(folder)[-1]
    (target / "logs" / "config").mkdir(parents=True)
    shutil.copy(source, target / "logs" / "config" / source.name)
    props = parse(source.read_text())
    ports = [address(props[f"{api}_address"], api)[1] for api in ("inference", "management", "metrics")]
    front = TorchServeFront(target, "--model-store", str(store), config=False, ports=ports)
    try:
        assert described(front.management_url) == state
        assert not front.seen("building ")  # the same Triton names and options as ours: the cache serves them
        assert call("POST", f"{front.inference_url}/predictions/beta", PHOTO.read_bytes())[0] == 200
    finally:
        front.stop()


def test_torchserve_restores_our_snapshot_with_its_sha256_as_we_described_it_when_started_from(ours, store):
    """Issue 52: the sha256 each of our entries adds is a field TorchServe 0.12's restore ignores (compared: every
    name, default version, worker bounds and batching; the live workers not, TorchServe may still be starting them)."""
    state, front, _ = ours
    first_stop = next(path for path in written(front.folder) if path.name.endswith("-shutdown.cfg"))
    snapshot = json.loads(parse(first_stop.read_text())["model_snapshot"])
    assert all("sha256" in entry for versions in snapshot["models"].values() for entry in versions.values())
    with torchserve.started(store.parent / "torchserve-from-ours", None, None, store=store,
                            properties={"max_workers_per_model": "2", "enable_model_api": "true",
                                        "model_snapshot": json.dumps(snapshot)}) as real:
        restored = described(real.management_url)

    def settings(described_state: dict) -> dict:
        return {name: (default, {v: numbers[:4] for v, numbers in versions.items()})
                for name, (default, versions) in described_state.items()}
    assert settings(restored) == settings(state)


def test_a_restored_model_whose_workers_fail_to_start_stays_registered_as_recorded_when_restarted(ours, store):
    """Issue 52: a restore whose workers did not start (a timeout under load) dropped the registration, and the
    startup snapshot after it: the next restart had lost an answered change. It stays registered, bounds kept, none
    running, said in one line; the snapshots keep recording it."""
    _, before, _ = ours
    first_stop = next(path for path in written(before.folder) if path.name.endswith("-shutdown.cfg"))
    props = parse(first_stop.read_text())
    snapshot = json.loads(props["model_snapshot"])
    beta = {**snapshot["models"]["beta"]["1.0"], "startupTimeout": 0}  # no worker can start in 0 s
    snapshot.update(models={"beta": {"1.0": beta}}, modelCount=1)
    target = store.parent / "restore-fails"
    (target / "logs" / "config").mkdir(parents=True)
    (target / "logs" / "config" / first_stop.name).write_text(
        snapshots.properties_text({**props, "model_snapshot": json.dumps(snapshot)}, 0))
    front = TorchServeFront(target, "--model-store", str(store), config=False, ports=before.ports)
    try:
        described_beta = json.loads(call("GET", f"{front.management_url}/models/beta")[1])[0]
        assert (described_beta["minWorkers"], described_beta["maxWorkers"], described_beta["workers"]) == (2, 3, [])
        assert front.seen("serve-repo: restored beta 1.0 with no worker running: its workers did not start")
        # written once the API is up (as TorchServe writes it): awaited, not assumed (a loaded machine lags)
        front.wait_for("config snapshots: ", 60)
        startup = next(path for path in written(target) if path.name.endswith("-startup.cfg"))
        assert model_snapshot(startup)["models"]["beta"]["1.0"]["minWorkers"] == 2
    finally:
        front.stop()


def test_latest_is_the_newest_by_its_names_time_when_several(tmp_path):
    for name in ("20261127072035809-startup.cfg", "20261127072104409-shutdown.cfg", "20261127072103755-snapshot.cfg",
                 "notes.txt", ".snapshot-x"):
        (tmp_path / name).write_text("")
    (tmp_path / "20991231235959999-dir").mkdir()
    assert snapshots.latest(tmp_path).name == "20261127072104409-shutdown.cfg"
    assert snapshots.latest(tmp_path / "none") is None


def test_properties_text_is_read_back_as_written_when_escaped(tmp_path):
    entries = {"a key": " lead=x:y#z!\\", "model_snapshot": '{\n  "name": "x"\n}', "inference_address": "http://h:1"}
    text = snapshots.properties_text(entries, 0)
    assert "inference_address=http\\://h\\:1\n" in text and "model_snapshot={\\n  \"name\"\\: \"x\"\\n}" in text
    assert parse(text) == entries


def test_a_snapshot_naming_an_archive_the_store_lacks_refuses_the_start_when_read(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "store").mkdir()
    models = {"m": {"1.0": {"defaultVersion": True, "marName": "m.mar", "minWorkers": 1, "maxWorkers": 1,
                            "batchSize": 1, "maxBatchDelay": 100}}}
    (tmp_path / "logs" / "config").mkdir(parents=True)
    (tmp_path / "logs" / "config" / "20260101000000000-snapshot.cfg").write_text(
        snapshots.properties_text({"model_snapshot": json.dumps({"models": models})}, 0))
    lines = []
    args = cli.parser().parse_args(["--model-store", "store"])
    assert run.serve(args, [], threading.Event(), lambda line, error=False: lines.append(line)) == 2
    assert lines[-1] == ("serve-repo: error: model_snapshot: Model archive file for model :m, version :1.0 not found "
                         "in model store")
    assert run.configure(cli.parser().parse_args(["--model-store", "store", "--ncs"])).snapshot is None  # none read


def test_a_model_snapshot_without_its_integers_is_refused_when_read(tmp_path):
    config = tmp_path / "config.properties"
    config.write_text(snapshots.properties_text({"model_snapshot": json.dumps(
        {"models": {"m": {"1.0": {"marName": "m.mar", "minWorkers": "one"}}}})}, 0))
    with pytest.raises(PropertiesError, match="model_snapshot=: model m version 1.0: minWorkers is not an integer"):
        settings(config)


def _snapshot_folder(tmp_path, models: dict) -> Path:
    (tmp_path / "store").mkdir(exist_ok=True)
    folder = tmp_path / "logs" / "config"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "20260101000000000-snapshot.cfg").write_text(
        snapshots.properties_text({"model_snapshot": json.dumps({"models": models})}, 0))
    return folder


def test_a_store_archive_other_than_the_one_registered_refuses_the_start_when_restored(tmp_path, monkeypatch):
    """Issue 52 F1: an outside file named like a store archive was restored as the store's archive under the
    caller's name. The snapshot records each archive's sha256; a restore whose archive differs does not start."""
    monkeypatch.chdir(tmp_path)
    _snapshot_folder(tmp_path, {"m": {"1.0": {"defaultVersion": True, "marName": "m.mar", "minWorkers": 1,
                                              "maxWorkers": 1, "batchSize": 1, "maxBatchDelay": 100,
                                              "sha256": hashlib.sha256(b"registered").hexdigest()}}})
    (tmp_path / "store" / "m.mar").write_bytes(b"another")
    lines = []
    args = cli.parser().parse_args(["--model-store", "store"])
    assert run.serve(args, [], threading.Event(), lambda line, error=False: lines.append(line)) == 2
    assert lines[-1] == ("serve-repo: error: model_snapshot: the model store's m.mar is not the archive registered as "
                         "model :m, version :1.0 (its sha256 differs from the snapshot's)")


def test_an_unreadable_newest_snapshot_falls_back_to_the_newest_readable_in_one_line_unless_refused(tmp_path,
                                                                                                   monkeypatch):
    """Issue 52: a truncated newest snapshot made the start exit 2 beside a whole older one."""
    monkeypatch.chdir(tmp_path)
    folder = _snapshot_folder(tmp_path, {})
    whole = (folder / "20260101000000000-snapshot.cfg").read_text()
    (folder / "20260102000000000-snapshot.cfg").write_text(whole[:len(whole) // 2])
    lines = []
    config = run.configure(cli.parser().parse_args(["--model-store", "store"]), lines.append)
    assert config.snapshot == {} and len(lines) == 1
    assert lines[0].startswith("snapshot 20260102000000000-snapshot.cfg cannot be read (") and \
        lines[0].endswith(f"starting from the newest one that can be, {folder / '20260101000000000-snapshot.cfg'}")
    with pytest.raises(PropertiesError, match="model_snapshot"):
        run.configure(cli.parser().parse_args(["--model-store", "store", "--snapshot-fallback", "off"]))


class _Registry:
    models: dict = {}
    defaults: dict = {}


def test_snapshots_beyond_the_newest_n_are_removed_when_saved(tmp_path):
    """Issue 52 F3: every change wrote a whole snapshot and none was removed."""
    saved = snapshots.Snapshots(_Registry(), {}, tmp_path / "config", keep=3)
    names = [saved.save("snapshot").name for _ in range(7)]
    assert sorted(path.name for path in (tmp_path / "config").iterdir()) == names[-3:]
    assert [path.name for path in tmp_path.iterdir()] == ["config"]  # no temporary file left beside it
    everything = snapshots.Snapshots(_Registry(), {}, tmp_path / "all", keep=0)
    assert len({everything.save("snapshot") for _ in range(12)}) == len(list((tmp_path / "all").iterdir())) == 12


def test_every_triton_name_of_the_longest_name_and_version_is_a_valid_file_name_when_derived():
    """Issue 52 F3: 300-character names failed with "File name too long" at the first worker."""
    from server.torchserve.naming import MAX_NAME, MAX_VERSION, SUFFIXES, refusal, triton_base

    name, version = "n" * MAX_NAME, "9" * MAX_VERSION
    taken = {name + suffix for suffix in SUFFIXES} | {f"{name}_v{version}"[:160]}  # the hashed forms are taken
    bases = [triton_base(name, version, first, set() if first else taken) for first in (True, False)]
    assert all(base and len(base + "_preprocess") <= 255 for base in bases) and refusal(name, version) is None
    assert refusal(name + "n", version).endswith(f"at most {MAX_NAME} characters")
    assert refusal(name, version + "9").startswith(f"Invalid model version of model {'n' * 80}...")
