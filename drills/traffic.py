"""Fault drills under traffic: paced requests (tensor and image path, HTTP and gRPC, all four at once) keep
arriving at a share of the measured capacity while a fault hits serve-repo; every request's outcome is kept.

    python -m drills.traffic --out drills/results/faults-under-traffic-resnet18.json
    python -m drills.traffic --proxy ...     (every request through serve-repo's proxy; drills.proxy: its own drills)

Per drill and load: recovery (per stream, the first correct answer to a request sent after its last
failure; and the first correct answer to a request sent after the fault), requests
failed (split into those sent before the fault, i.e. in flight or queued, and those sent after it), lost
(no answer within --hang-limit: must be 0), wrong answers (must be 0), the good answers' p99 around the
fault and the longest any request waited. After SIGTERM and kill -9 of serve-repo, serve-repo is started again
on the same ports once it has exited (as a process manager would; --no-restart: left stopped), so those drills
have a recovery too. tests/test_traffic.py runs drills at low load and checks them."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from common import names
from common.cli import OneLineParser, write_result
from drills.faults import CRASHING_BODY, SEED, TOLERANCE, build_small_repo, image, reference_for
from drills.outcomes import Outcome, summary
from perf.load import OpenLoop, closed_loop
from perf.serve import ServeRepo
from perf.samples import CAT
from server.procfs import running_stubs, stubs_of

STREAMS = (("tensor", "http"), ("tensor", "grpc"), ("image", "http"), ("image", "grpc"))


@dataclass
class Traffic:
    """Paced requests on the four streams (perf.load.OpenLoop) until stop(); every request gets exactly one Outcome."""
    serve: ServeRepo
    model: str
    expected: dict
    rate: float                 # requests per second, all streams together
    hang_limit: float = 60
    outcomes: list = field(default_factory=list)

    def __post_init__(self):
        self.fault_at = float("inf")
        self._local = threading.local()
        self.ready_again: float | None = None
        self._sender = OpenLoop(self._send, self.rate)

    @property
    def start_delay(self) -> float:
        """The worst wait of a request for a free sender: 0 but for ours (the server's is in the outcomes)."""
        return self._sender.lag

    def start(self) -> "Traffic":
        self._sender.start()
        return self

    def _send(self, index: int, due: float) -> None:
        path, protocol = STREAMS[index % len(STREAMS)]
        name = f"{path}/{protocol}"
        try:
            if getattr(self._local, "clients", None) is None:
                self._local.clients = clients(self.serve, self.hang_limit)
            logits = infer(self._local.clients[protocol], protocol, path, self.model, self.hang_limit)
            outcome = "ok" if close(logits, self.expected[path]) else "wrong"
            detail = "" if outcome == "ok" else "answer differs from the reference"
        except Exception as exc:  # noqa: BLE001 - every outcome is kept
            detail = " ".join(str(exc).split())[:160]
            outcome = "lost" if time.monotonic() - due >= self.hang_limit - 0.5 else "error"
            if outcome == "error" and protocol == "http" and getattr(self._local, "clients", None):
                with contextlib.suppress(Exception):  # a dropped connection: the next request opens a new one
                    self._local.clients["http"].close()
                self._local.clients["http"] = http_client(self.serve, self.hang_limit)
        self.outcomes.append(Outcome(name, due - self.fault_at, time.monotonic() - due, outcome, detail))

    def stop(self) -> None:
        self._sender.stop()  # each request ends by the hang limit at the latest


def http_client(serve: ServeRepo, timeout: float):
    import tritonclient.http as httpclient

    return httpclient.InferenceServerClient(f"127.0.0.1:{serve.ports[0]}", network_timeout=timeout,
                                            connection_timeout=timeout)


def clients(serve: ServeRepo, timeout: float) -> dict:
    from clients.classify import grpc_client

    return {"http": http_client(serve, timeout), "grpc": grpc_client(f"127.0.0.1:{serve.ports[1]}")}


def infer(client, protocol: str, path: str, model: str, timeout: float) -> np.ndarray:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    module = httpclient if protocol == "http" else grpcclient
    if path == "tensor":
        data, name, dtype, target = image(0), "IMAGE", "FP32", model
    else:
        data, name, dtype, target = np.array([[CAT.read_bytes()]], dtype=object), "IMAGE_BYTES", "BYTES", names.image_model(model)
    tensor = module.InferInput(name, list(data.shape), dtype)
    tensor.set_data_from_numpy(data)
    kwargs = {"client_timeout": timeout} if protocol == "grpc" else {}
    return client.infer(target, [tensor], **kwargs).as_numpy("LOGITS")


def close(logits, expected: np.ndarray) -> bool:
    return logits is not None and logits.shape == expected.shape and \
        float(np.abs(logits - expected).max() / np.abs(expected).max()) <= TOLERANCE


def references(serve: ServeRepo, model: str, tensor_reference: np.ndarray) -> dict:
    """What each path must answer: the tensor path as in-process; the image path as served before the fault."""
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(f"127.0.0.1:{serve.ports[0]}")
    served = infer(client, "http", "tensor", model, 60)
    if not close(served, tensor_reference):
        raise AssertionError("the served tensor path differs from in-process before any fault")
    return {"tensor": tensor_reference, "image": infer(client, "http", "image", model, 60)}


def capacity(serve: ServeRepo, model: str, expected: dict, seconds: float = 8, concurrency: int = 8) -> float:
    """Requests per second the four streams sustain together, closed loop (`concurrency` clients, perf.load)."""
    def connect(index: int):
        path, protocol = STREAMS[index % len(STREAMS)]
        client = clients(serve, 60)[protocol]
        return (lambda: infer(client, protocol, path, model, 60)), (lambda: None)

    found = closed_loop(connect, concurrency, seconds, warmup=2)
    return sum(1 for sample in found.samples if not sample.error) / seconds


# Faults: each takes the running serve-repo and the model, and returns what it wants recorded.
def kill_stub(serve: ServeRepo, model: str) -> dict:
    stub = next(s for s in stubs_of(serve.triton_pid) if s.model == model and s.alive)
    os.kill(stub.pid, signal.SIGKILL)
    return {"killed": stub.instance}


def crashing_request(serve: ServeRepo, model: str) -> dict:
    def send():
        with socket.create_connection(("127.0.0.1", serve.ports[0]), timeout=60) as sock:
            sock.sendall(b"POST /v2/models/%s/infer HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json"
                         b"\r\nContent-Length: %d\r\n\r\n%s" % (model.encode(), len(CRASHING_BODY), CRASHING_BODY))
            try:
                sock.recv(4096)
            except OSError:
                pass
    threading.Thread(target=send, daemon=True).start()
    return {"request_bytes": len(CRASHING_BODY)}


def kill_preprocess_stub(serve: ServeRepo, model: str) -> dict:
    return kill_stub(serve, names.named(model, "preprocess"))


def kill_tritonserver(serve: ServeRepo, model: str) -> dict:
    os.kill(serve.triton_pid, signal.SIGKILL)
    return {}


def terminate_serve_repo(serve: ServeRepo, model: str) -> dict:
    serve.process.send_signal(signal.SIGTERM)
    return {}


def kill_serve_repo(serve: ServeRepo, model: str) -> dict:
    serve.process.kill()
    return {}


FAULTS = {  # name: (fault, whether serving comes back: after a stop nothing does, by design)
    "stub_killed": (kill_stub, True),
    "preprocess_stub_killed": (kill_preprocess_stub, True),
    "tritonserver_killed": (kill_tritonserver, True),
    "crashing_json_request": (crashing_request, True),
    "sigterm": (terminate_serve_repo, False),
    "kill_9_serve_repo": (kill_serve_repo, False),
}


def drill(repository: Path, model: str, name: str, tensor_reference: np.ndarray, rate: float,
          before: float = 4, watch: float = 20, hang_limit: float = 60, flags: tuple = (),
          restart: bool = True, faults: dict | None = None) -> dict:
    """One fault under `rate` requests/s on a fresh serve-repo; the figures of every request. After a fault
    that stops serve-repo (SIGTERM, kill -9), `restart` starts it again on the same ports as soon as it has
    exited, as a process manager does (systemd Restart=always with RestartSec=0, Docker restart: always)."""
    fault, comes_back = (faults or FAULTS)[name]
    restarter = Restarter(repository, flags) if restart and not comes_back else None
    serve = ServeRepo(repository, *flags)
    try:
        expected = references(serve, model, tensor_reference)
        traffic = Traffic(serve, model, expected, rate, hang_limit).start()
        time.sleep(before)
        mark, stubs = len(serve.lines), _stubs(serve)
        traffic.fault_at = time.monotonic()
        details = fault(serve, model)
        watcher = restarter.run if restarter else _note_ready_again
        threading.Thread(target=watcher, args=(serve, mark, traffic), daemon=True).start()
        time.sleep(watch)
        traffic.stop()
        status = serve.process.poll()
        now = restarter.serve if restarter and restarter.serve else serve
        after = _stubs(now)
        # Which stubs outlived the fault (same process) and which are new: one dead instance replaced alone?
        details["stubs_kept"] = sorted(name for pid, name in stubs.items() if pid in after)
        details["stubs_new"] = sorted(name for pid, name in after.items() if pid not in stubs)
        # The old server's stubs still running beside the new one (a stub can hang on its own exit).
        running = running_stubs() - set(after)
        details["old_stubs_left"] = sorted(name for pid, name in stubs.items() if pid in running)
        log = [line for line in serve.lines[mark:] if "serve-repo" in line or "tritonserver" in line][:6]
        if restarter:
            details.update(restarter.figures())
            log += [line for line in (restarter.serve.lines if restarter.serve else [])
                    if "serve-repo" in line or "ready" in line][:3]
        log = [line.split("  log /")[0] for line in log]  # committed: no machine paths
    finally:
        serve.stop()
        if restarter and restarter.serve:
            restarter.serve.stop()
    result = summary(traffic.outcomes, comes_back or bool(restarter and restarter.serve))
    if traffic.ready_again is not None:  # answers given while the supervisor was still bringing it back
        result["supervisor_ready_again_after_s"] = round(traffic.ready_again, 2)
        result["ok_answered_before_supervisor_done"] = sum(
            1 for o in traffic.outcomes if o.result == "ok" and 0 < o.sent + o.waited < traffic.ready_again)
    return {"fault": name, "rate_per_s": round(rate, 1), **details, **result,
            "worst_start_delay_s": round(traffic.start_delay, 3), "serve_repo_exit": status, "log": log}


class Restarter:
    """Starts serve-repo again on the same ports once the stopped one has exited; when it did, and when the
    new one said tritonserver was ready (that time is also the drill's `supervisor_ready_again_after_s`)."""

    def __init__(self, repository: Path, flags: tuple):
        self.repository, self.flags = repository, flags
        self.serve: ServeRepo | None = None
        self.exited = self.ready = None
        self.error = ""

    def run(self, old: ServeRepo, mark: int, traffic: Traffic) -> None:  # the same call as _note_ready_again
        old.process.wait()
        self.exited = time.monotonic() - traffic.fault_at
        try:
            self.serve = ServeRepo(self.repository, *self.flags, timeout=120, ports=old.ports)
            self.ready = traffic.ready_again = time.monotonic() - traffic.fault_at
        except AssertionError as exc:
            self.error = str(exc)[:300]

    def figures(self) -> dict:
        figures = {"serve_repo_exited_after_s": self.exited and round(self.exited, 2),
                   "restart_ready_after_s": self.ready and round(self.ready, 2)}
        return {**figures, "restart_error": self.error} if self.error else figures


def _stubs(serve: ServeRepo) -> dict:
    try:
        return {s.pid: s.instance for s in stubs_of(serve.triton_pid) if s.alive and s.serves}
    except AssertionError:  # serve-repo is gone (stopped, killed): so are its stubs
        return {}


def _note_ready_again(serve: ServeRepo, mark: int, traffic: Traffic, limit: float = 120) -> None:
    """When the supervisor says the model (or tritonserver) is ready again, in seconds after the fault."""
    while time.monotonic() - traffic.fault_at < limit:
        if any("ready again" in line for line in serve.lines[mark:]):
            traffic.ready_again = time.monotonic() - traffic.fault_at
            return
        time.sleep(0.02)


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m drills.traffic", description=__doc__)
    p.add_argument("--model", default="resnet18", help="Default: resnet18 (random weights, seed 0).")
    p.add_argument("--loads", default="0.5,1.0", help="shares of the measured capacity. Default: 0.5,1.0.")
    p.add_argument("--faults", default=",".join(FAULTS), help=f"Default: all ({', '.join(FAULTS)}).")
    p.add_argument("--watch", type=float, default=20, help="seconds of traffic after the fault. Default: 20.")
    p.add_argument("--instances", type=int, default=1, help="model instances. Default: 1.")
    p.add_argument("--no-restart", action="store_true", help="after SIGTERM / kill -9 of serve-repo, do not start "
                   "it again (by default: again on the same ports once it has exited, as a process manager would).")
    p.add_argument("--proxy", action="store_true", help="every request through serve-repo's proxy (--proxy on).")
    p.add_argument("--out", type=Path, help="JSON to write.")
    args = p.parse_args(argv)

    from perf.bench import machine

    tensor_reference = reference_for(args.model, SEED)(image(0))
    flags = ("--proxy", "on") if args.proxy else ()
    results: dict = {"model": args.model, "instances": args.instances, "proxy": args.proxy, "machine": machine(),
                     "streams": ["/".join(s) for s in STREAMS], "runs": []}
    with tempfile.TemporaryDirectory(prefix="traffic-") as tmp:
        repo = build_small_repo(args.model, Path(tmp), args.instances)
        serve = ServeRepo(repo, *flags)
        try:
            results["capacity_per_s"] = round(capacity(serve, args.model, references(serve, args.model,
                                                                                     tensor_reference)), 1)
        finally:
            serve.stop()
        print("capacity", results["capacity_per_s"], "requests/s", flush=True)
        for name in args.faults.split(","):
            for share in (float(x) for x in args.loads.split(",")):
                run = drill(repo, args.model, name, tensor_reference, share * results["capacity_per_s"],
                            watch=args.watch, flags=flags, restart=not args.no_restart)
                run["load"] = share
                print(json.dumps(run), flush=True)
                results["runs"].append(run)
    write_result(results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
