"""Crash drill (issue 52): `kill -9` of serve-repo's TorchServe front at random moments while a client registers, scales
and unregisters over REST and gRPC; after each restart from the newest snapshot every change that was answered is
there, nothing else is, and each model with workers answers its own archive's answer.

    python -m drills.registrations --kills 10 --out drills/results/registrations-crash.json
"""
from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import psutil

from common.cli import OneLineParser, write_result
from perf.bench import machine
from perf.serve import TorchServeFront
from perf.torchserve import executables
from server.torchserve.proto import management_pb2, management_pb2_grpc

# A custom handler's archive whose answer names it: the sum of the values times its scale.
HANDLER = '''
import json
import os

from ts.torch_handler.base_handler import BaseHandler


class Scaled(BaseHandler):
    def initialize(self, context):
        with open(os.path.join(context.system_properties["model_dir"], "scale.json")) as file:
            self.scale = json.load(file)["scale"]
        self.initialized = True

    def preprocess(self, data):
        rows = [row.get("data") or row.get("body") for row in data]
        return [json.loads(row) if isinstance(row, (bytes, bytearray)) else row for row in rows]

    def inference(self, rows):
        return [{"sum": sum(row["values"]) * self.scale} for row in rows]

    def postprocess(self, answers):
        return answers
'''
SCALES = {"a.mar": 2, "b.mar": 3}
NAMES = [f"m{i}" for i in range(8)]
TIMEOUT = 300


def make_archives(store: Path) -> None:
    for file, scale in SCALES.items():
        src = store.parent / f"{file}-src"
        src.mkdir(parents=True)
        (src / "scaled.py").write_text(HANDLER)
        (src / "scale.json").write_text(json.dumps({"scale": scale}))
        subprocess.run([executables()["torch-model-archiver"], "--model-name", file.removesuffix(".mar"), "--version",
                        "1.0", "--handler", str(src / "scaled.py"), "--extra-files", str(src / "scale.json"),
                        "--export-path", str(store)], check=True, capture_output=True, timeout=120)


def rest(method: str, url: str, body: bytes | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=body, method=method,
                                     headers={"Content-Type": "application/json"} if body else {})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


class Client:
    """Random changes over REST and gRPC; `expected`: what the answered ones left; `uncertain`: names whose last change
    got no answer (the kill came first): either state is right for them."""

    def __init__(self, front: TorchServeFront, rng: random.Random, expected: dict, uncertain: set, history: list):
        self.front, self.rng, self.expected, self.uncertain = front, rng, expected, uncertain
        self.channel = grpc.insecure_channel(f"127.0.0.1:{front.grpc_ports[1]}")
        self.grpc = management_pb2_grpc.ManagementAPIsServiceStub(self.channel)
        self.answered = 0
        self.history = history  # each change asked for and whether it was answered OK, every round's

    def change(self) -> None:
        name = self.rng.choice(NAMES)
        over_grpc, synchronous = self.rng.random() < 0.5, self.rng.random() < 0.5
        if name not in self.expected:
            archive, workers = self.rng.choice(sorted(SCALES)), int(self.rng.random() < 0.25)
            wanted = {"archive": archive, "min": workers, "max": workers}
            if over_grpc:
                ok = self._grpc("RegisterModel", management_pb2.RegisterModelRequest(
                    url=archive, model_name=name, initial_workers=workers, synchronous=synchronous))
            else:
                ok = self._rest("POST", f"/models?url={archive}&model_name={name}&initial_workers={workers}"
                                        f"&synchronous={str(synchronous).lower()}")
        elif self.rng.random() < 0.6:
            low = int(self.rng.random() < 0.3)
            high = low + self.rng.randrange(2)
            wanted = {**self.expected[name], "min": low, "max": high}
            if over_grpc:  # TorchServe's gRPC: 0 is an unset field (min_worker 1, max_worker min_worker)
                low, high = low or 1, high or low or 1
                wanted.update(min=low, max=max(high, low))
                ok = self._grpc("ScaleWorker", management_pb2.ScaleWorkerRequest(
                    model_name=name, min_worker=low, max_worker=high, synchronous=synchronous))
            else:
                ok = self._rest("PUT", f"/models/{name}?min_worker={low}&max_worker={high}"
                                       f"&synchronous={str(synchronous).lower()}")
        else:
            wanted = None
            if over_grpc:
                ok = self._grpc("UnregisterModel", management_pb2.UnregisterModelRequest(model_name=name))
            else:
                ok = self._rest("DELETE", f"/models/{name}")
        self.history.append(f"{name} {'grpc' if over_grpc else 'rest'} sync={synchronous} {wanted} -> {ok}")
        if ok is None:  # no answer: killed meanwhile
            self.uncertain.add(name)
            raise ConnectionError(name)
        if ok:
            self.answered += 1
            if wanted is None:
                self.expected.pop(name, None)
            else:
                self.expected[name] = wanted

    def _rest(self, method: str, path: str) -> bool | None:
        try:
            status, _ = rest(method, self.front.management_url + path)
        except OSError:
            return None
        return status in (200, 202)

    def _grpc(self, call: str, request) -> bool | None:
        try:
            getattr(self.grpc, call)(request, timeout=TIMEOUT)
        except grpc.RpcError as exc:
            return None if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                                          grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN) else False
        return True

    def run(self, stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                self.change()
        except ConnectionError:
            pass
        finally:
            self.channel.close()


def kill_9(front: TorchServeFront) -> None:
    """serve-repo killed; its tritonserver and stubs gone (they follow it) before the next start takes the ports."""
    process = psutil.Process(front.process.pid)
    children = process.children(recursive=True)
    process.kill()
    front.process.wait(30)
    _, alive = psutil.wait_procs(children, timeout=60)
    for child in alive:  # not expected: said in the result
        child.kill()


def check(front: TorchServeFront, expected: dict, uncertain: set) -> dict:
    """What the restarted front serves against what was answered: lost, extra, changed and wrong-archive names."""
    status, body = rest("GET", f"{front.management_url}/models")
    listed = {entry["modelName"] for entry in json.loads(body)["models"]}
    problems = {"lost": sorted(set(expected) - listed - uncertain),
                "extra": sorted(listed - set(expected) - uncertain), "changed": [], "wrong_archive": [],
                "not_answering": []}
    for name in sorted(listed & set(expected)):
        described = json.loads(rest("GET", f"{front.management_url}/models/{name}")[1])[0]
        wanted = expected[name]
        if name not in uncertain and (described["minWorkers"], described["maxWorkers"]) != (wanted["min"],
                                                                                             wanted["max"]):
            problems["changed"].append(f"{name}: {described['minWorkers']}..{described['maxWorkers']} workers, answered "
                                       f"{wanted['min']}..{wanted['max']}")
        if Path(described["modelUrl"]).name != wanted["archive"]:
            problems["wrong_archive"].append(f"{name}: {described['modelUrl']}, registered {wanted['archive']}")
        elif described["minWorkers"] and name not in uncertain:
            status, answer = rest("POST", f"{front.inference_url}/predictions/{name}", b'{"values": [1, 2]}')
            if status != 200:
                problems["not_answering"].append(f"{name}: {status} {answer[:200].decode(errors='replace')}")
            elif json.loads(answer).get("sum") != 3 * SCALES[wanted["archive"]]:
                problems["wrong_archive"].append(f"{name}: answered {answer[:200].decode(errors='replace')}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=10, help="kill -9 rounds. Default: 10.")
    parser.add_argument("--seed", type=int, default=0, help="the random changes and kill times. Default: 0.")
    parser.add_argument("--out", type=Path, help="the result's JSON file. Default: printed only.")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    folder = Path(tempfile.mkdtemp(prefix="crash-drill-"))
    store = folder / "model_store"
    store.mkdir()
    make_archives(store)
    expected: dict = {}
    rounds, history = [], []
    front = TorchServeFront(folder / "front", model_store=str(store), enable_model_api="true",
                            disable_token_authorization="true", max_workers_per_model="2")
    try:
        for kill in range(args.kills):
            uncertain: set = set()
            client = Client(front, rng, expected, uncertain, history)
            stop = threading.Event()
            worker = threading.Thread(target=client.run, args=(stop,))
            worker.start()
            delay = rng.uniform(0.2, 6.0)
            time.sleep(delay)
            kill_9(front)
            before = front.lines
            worker.join(TIMEOUT)
            ports, grpc_ports = front.ports, front.grpc_ports
            front = TorchServeFront(folder / "front", "--model-store", str(store), config=False, ports=ports)
            front.grpc_ports = grpc_ports  # the snapshot's, as its inference_address and the others
            problems = check(front, expected, uncertain)
            history.append(f"-- kill {kill}")
            problems["history"] = [line for line in history
                                   for name in [c.split(":")[0] for c in problems["changed"]] + problems["lost"]
                                   if line.startswith(f"{name} ")]
            problems["log"] = [line.replace(str(folder), "DRILL")[:300] for line in before + front.lines for name in problems["lost"] + [c.split(":")[0] for c in problems["changed"]]
                               if f" {name} " in line or f":{name}," in line or "could not" in line or "failed" in line][:10]
            rounds.append({"kill_after_s": round(delay, 2), "answered_changes": client.answered,
                           "unanswered": sorted(uncertain), "registered_after": len(expected),
                           "restart_ready_s": round(front.took, 1), **problems})
            print(json.dumps(rounds[-1]), flush=True)
            for name in uncertain:  # what the restart holds is now the truth for these
                found, body = rest("GET", f"{front.management_url}/models/{name}")
                if found != 200:
                    expected.pop(name, None)
                else:
                    described = json.loads(body)[0]
                    expected[name] = {"archive": Path(described["modelUrl"]).name, "min": described["minWorkers"],
                                      "max": described["maxWorkers"]}
    finally:
        front.stop()
        snapshot_bytes = sum(p.stat().st_size for p in (folder / "front" / "logs" / "config").iterdir())
        shutil.rmtree(folder, ignore_errors=True)
    totals = {key: sum(len(r[key]) for r in rounds) for key in ("lost", "extra", "changed", "wrong_archive", "not_answering")}
    result = {"command": "python -m drills.registrations " + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": machine(), "seed": args.seed, "kills": len(rounds), "answered_changes": sum(r["answered_changes"] for r in rounds), **totals,
              "snapshot_folder_bytes": snapshot_bytes, "rounds": rounds}
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}))
    write_result(result, args.out)
    return 0 if not any(totals.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
