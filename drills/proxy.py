"""Drills through the proxy (serve-repo --proxy on): the crashing JSON request sent every second under paced
traffic, tritonserver killed under traffic, and what the proxy adds to a request (direct vs through it).

    python -m drills.proxy --out drills/results/proxy-resnet18.json

Traffic and outcomes as drills.traffic (four streams: tensor and image path, HTTP and gRPC), all through the
proxy's public ports. Reported per drill: requests failed (sent before / after the fault), lost, wrong,
recovery; for the crash drill, the proxy's answers to the crash requests and whether tritonserver was ever
restarted (its pid, and serve-repo's log). The added latency: closed loop at concurrency 1, requests to
Triton's private port and through the proxy alternating, p50 and p99 of each, per stream."""
from __future__ import annotations

import json
import socket
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path

from common.cli import OneLineParser, write_result
from drills.faults import CRASHING_BODY, SEED, WRAPPING_BODY, build_small_repo, image, reference_for
from perf.load import interleaved
from perf.serve import ServeRepo
from drills.traffic import STREAMS, capacity, drill, infer, kill_tritonserver, references

PROXY = ("--proxy", "on")


def crash_every_second(serve: ServeRepo, model: str, count: int = 100) -> dict:
    """The ~100-byte requests that abort tritonserver 2.51 (the huge shape and the wrapping one, in turn), sent
    `count` times, one a second, to the proxy."""
    details = {"crash_requests": 0, "crash_answers": {}, "tritonserver_pid_unchanged": None}
    pid = serve.triton_pid

    def send():
        for index in range(count):
            status = _post(serve.ports[0], model, (CRASHING_BODY, WRAPPING_BODY)[index % 2])
            details["crash_requests"] += 1
            details["crash_answers"][status] = details["crash_answers"].get(status, 0) + 1
            time.sleep(1)
        try:
            details["tritonserver_pid_unchanged"] = serve.triton_pid == pid
        except AssertionError:
            details["tritonserver_pid_unchanged"] = False
    threading.Thread(target=send, daemon=True).start()
    return details


def _post(port: int, model: str, body: bytes) -> str:
    """Status line's code and the proxy's rule ("400 shape-within-body"), or what went wrong on the socket."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(b"POST /v2/models/%s/infer HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json"
                         b"\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (model.encode(), len(body), body))
            reply = b""
            while chunk := sock.recv(4096):
                reply += chunk
    except OSError as exc:
        return type(exc).__name__
    code = reply.split(b" ", 2)[1].decode() if reply.startswith(b"HTTP/") else "no answer"
    rule = reply.split(b"proxy rule ", 1)[1].split(b":", 1)[0].decode() if b"proxy rule " in reply else "?"
    return f"{code} {rule}"


def added_latency(serve: ServeRepo, model: str, requests: int = 300) -> dict:
    """Per stream: p50/p99 of requests straight to Triton's private ports and through the proxy, alternating
    one by one (so both see the same machine), and the proxy's added p50 in ms."""
    from clients.classify import grpc_client
    import tritonclient.http as httpclient

    http, grpc = serve.private_ports
    direct = {"http": httpclient.InferenceServerClient(f"127.0.0.1:{http}"), "grpc": grpc_client(f"127.0.0.1:{grpc}")}
    proxied = {"http": httpclient.InferenceServerClient(f"127.0.0.1:{serve.ports[0]}"),
               "grpc": grpc_client(f"127.0.0.1:{serve.ports[1]}")}
    figures = {}
    for path, protocol in STREAMS:
        found = interleaved({route: lambda c=clients[protocol]: infer(c, protocol, path, model, 60)
                             for route, clients in (("proxy", proxied), ("direct", direct))},
                            rounds=requests, warm_rounds=20)
        point = {route: load.summary() for route, load in found.items()}
        figures[f"{path}/{protocol}"] = {
            **{f"{route}_{q}_ms": round(point[route][f"{q}_ms"], 3) for route in ("direct", "proxy") for q in ("p50", "p99")},
            "added_p50_ms": round(point["proxy"]["p50_ms"] - point["direct"]["p50_ms"], 3)}
    return figures


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m drills.proxy", description=__doc__)
    p.add_argument("--model", default="resnet18", help="Default: resnet18 (random weights, seed 0).")
    p.add_argument("--load", type=float, default=0.5, help="share of the measured capacity. Default: 0.5.")
    p.add_argument("--crashes", type=int, default=100, help="crash requests, one a second. Default: 100.")
    p.add_argument("--watch", type=float, default=20,
                   help="seconds of traffic after tritonserver is killed. Default: 20.")
    p.add_argument("--latency-requests", type=int, default=300, help="per stream and route. Default: 300.")
    p.add_argument("--out", type=Path, help="JSON to write. Default: print only.")
    args = p.parse_args(argv)

    from perf.bench import machine

    tensor_reference = reference_for(args.model, SEED)(image(0))
    results: dict = {"command": "python -m drills.proxy " + " ".join(argv if argv is not None else sys.argv[1:]),
                     "model": args.model, "machine": machine(), "streams": ["/".join(s) for s in STREAMS],
                     "runs": []}
    with tempfile.TemporaryDirectory(prefix="proxy-drill-") as tmp:
        repo = build_small_repo(args.model, Path(tmp), 1)
        serve = ServeRepo(repo, *PROXY)
        try:
            results["added_latency_c1"] = added_latency(serve, args.model, args.latency_requests)
            print(json.dumps(results["added_latency_c1"]), flush=True)
            results["capacity_per_s"] = round(capacity(serve, args.model, references(serve, args.model,
                                                                                     tensor_reference)), 1)
        finally:
            serve.stop()
        print("capacity through the proxy", results["capacity_per_s"], "requests/s", flush=True)
        faults = {"crashing_json_every_second": (partial(crash_every_second, count=args.crashes), True),
                  "tritonserver_killed": (kill_tritonserver, True)}
        for name, watch in (("crashing_json_every_second", args.crashes + 5.0), ("tritonserver_killed", args.watch)):
            run = drill(repo, args.model, name, tensor_reference, args.load * results["capacity_per_s"],
                        watch=watch, flags=PROXY, faults=faults)
            run["load"] = args.load
            run["server_restarts"] = sum("tritonserver died" in line for line in run["log"])
            print(json.dumps(run), flush=True)
            results["runs"].append(run)
    write_result(results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
