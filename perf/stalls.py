"""Low-load tail and overload bound of a build: closed-loop requests at concurrency 1 and 2 on the tensor and
image paths over HTTP and gRPC (every latency kept: p50, p99, max, how many over 5x p50), then open-loop
load at 4x capacity (accepted p99, how fast a refusal comes back, requests with no outcome).

--via proxy (the default): served as today's defaults serve it, `serve-repo --proxy on` (--serve-flags passes
more), every request through the proxy's HTTP and gRPC ports; the proxy bounds overload (perf.overload).
--via triton: tritonserver alone, as the older entries of stalls-resnet18.json were measured.

Triton 2.51's dynamic batcher stops prefetching when a queue policy is set, and then can sleep 500 ms
with a request queued (README, "No stall by default"): this measures, per build, whether that happens.

    python -m perf.stalls --label proxy-defaults --out perf/results/stalls-resnet18.json          # today's defaults
    python -m perf.stalls --via triton --label one-instance --build-flags=--instances=1 --out ...  # another build, no proxy
"""
from __future__ import annotations

import contextlib
import json
import shlex
import sys
import tempfile
from pathlib import Path

import numpy as np

from common.cli import OneLineParser
from perf import load

SLOW = 5  # a request is a stall above SLOW x the run's p50


def closed_loop(urls: dict, model: str, path: str, protocol: str, concurrency: int, requests: int,
                image: np.ndarray, jpeg: bytes) -> dict:
    """`concurrency` clients (perf.load), each sending its next request the instant its answer arrives, `requests`
    in all after one each to warm its connection and the first batch."""
    from perf.loadgen import encoded, infer_client

    data = encoded(jpeg, batched=True) if path == "image" else image
    connect = infer_client(urls[protocol], f"{model}_image" if path == "image" else model, data, protocol)

    def warmed(index: int):
        send, close = connect(index)
        send()
        return send, close

    found = load.closed_loop(warmed, concurrency, requests=requests)
    ms = np.array([sample.latency for sample in found.samples if not sample.error]) * 1000
    p50 = float(np.percentile(ms, 50))
    return {"path": path, "protocol": protocol, "concurrency": concurrency, "requests": len(ms),
            "errors": len(found.samples) - len(ms), "p50_ms": round(p50, 2), "p99_ms": round(float(np.percentile(ms, 99)), 2),
            "max_ms": round(float(ms.max()), 2), "max_over_p50": round(float(ms.max()) / p50, 2),
            f"over_{SLOW}x_p50": int((ms > SLOW * p50).sum()), "over_300_ms": int((ms > 300).sum())}


@contextlib.contextmanager
def _served(repo: Path, via: str, serve_flags: list[str]):
    """{"urls": {"http": ..., "grpc": ...}, "ready": callable, "limits": the proxy's overload bounds} while served
    `via` the proxy (serve-repo --proxy on) or tritonserver alone."""
    if via == "proxy":
        from perf.serve import ServeRepo

        serve = ServeRepo(repo, "--proxy", "on", *serve_flags)
        served = {"urls": {"http": f"127.0.0.1:{serve.ports[0]}", "grpc": f"127.0.0.1:{serve.ports[1]}"},
                  "ready": lambda: serve.process.poll() is None and serve.http.is_server_ready(),
                  "limits": serve.overload_limits}
        try:
            yield served
        finally:
            serve.stop()
    else:
        from server.triton import TritonServer

        with TritonServer.local(repo) as server:
            yield {"urls": {"http": server.http_url, "grpc": server.grpc_url}, "ready": server.ready}


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m perf.stalls", description=__doc__)
    p.add_argument("--model", default="resnet18", help="torchvision model (random weights). Default: resnet18.")
    p.add_argument("--label", default="defaults", help="name of the build in the results. Default: defaults.")
    p.add_argument("--build-flags", default="", help="build-repo flags over the defaults, one string. Default: none.")
    p.add_argument("--via", choices=("proxy", "triton"), default="proxy",
                   help="proxy: serve-repo --proxy on, requests through the proxy's ports; triton: tritonserver "
                        "alone. Default: proxy.")
    p.add_argument("--serve-flags", default="", help="serve-repo flags, one string (e.g. \"--queue-ms 250\"); "
                                                       "--via proxy only. Default: none.")
    p.add_argument("--requests", type=int, default=2000, help="requests per run. Default: 2000.")
    p.add_argument("--overload-seconds", type=float, default=20, help="open loop at 4x capacity; 0 skips. Default: 20.")
    p.add_argument("--out", type=Path, help="JSON to write (one entry per --label, others kept). Default: none.")
    args = p.parse_args(argv)
    if args.via == "triton" and args.serve_flags:
        p.error("--serve-flags go to serve-repo: --via proxy")

    from builder import cli as build_repo
    from common.cpu import cpuinfo
    from perf.loadgen import run_load
    from perf.overload import open_loop
    from perf.samples import CAT

    image = np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)
    jpeg = CAT.read_bytes()
    with tempfile.TemporaryDirectory(prefix="stalls-") as tmp:
        repo = Path(tmp) / "repo"
        flags = ["--model", args.model, "--weights", "random", "--output", str(repo), "--kind", "cpu",
                 *shlex.split(args.build_flags)]
        if build_repo.main(flags):
            print("perf.stalls: build-repo failed", file=sys.stderr)
            return 1
        config = (repo / args.model / "config.pbtxt").read_text()
        with _served(repo, args.via, shlex.split(args.serve_flags)) as served:
            urls = served["urls"]
            runs = []
            for path in ("tensor", "image"):
                for protocol in ("grpc", "http"):
                    for concurrency in (1, 2):
                        run = closed_loop(urls, args.model, path, protocol, concurrency, args.requests, image, jpeg)
                        runs.append(run)
                        print(json.dumps(run), flush=True)
            overload = None
            if args.overload_seconds > 0:
                capacity = run_load(urls["http"], args.model, 8, 10, image, label="capacity").throughput
                overload = open_loop(urls["grpc"], args.model, image, 4 * capacity, args.overload_seconds)
                overload.update(factor=4, capacity_req_per_s=round(capacity, 1))
                print(json.dumps(overload), flush=True)
            ready = served["ready"]()
    entry = {"command": " ".join(["python -m perf.stalls", *(argv if argv is not None else sys.argv[1:])]),
             "cpu": cpuinfo("model name"), "via": args.via, "build_flags": shlex.split(args.build_flags),
             "serve_flags": shlex.split(args.serve_flags), **served.get("limits", {}),
             "queue_policy": "default_queue_policy" in config, "instances": config.count("instance_group"),
             "runs": runs, "worst_max_over_p50": max(run["max_over_p50"] for run in runs),
             "stalls": sum(run[f"over_{SLOW}x_p50"] for run in runs), "overload_4x": overload,
             "server_ready_after": ready}
    if args.out:
        results = json.loads(args.out.read_text()) if args.out.exists() else {}
        results[args.label] = entry
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps({k: v for k, v in entry.items() if k != "runs"}, indent=1))
    return 0 if ready else 1


if __name__ == "__main__":
    sys.exit(main())
