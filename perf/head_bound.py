"""What the TorchServe front's head and body bounds (server/torchserve/bounded_http.py, issue 42 B1) add to a request:
the same small app served by uvicorn's own httptools protocol and by the bounded one, requests alternating one by one
on a kept-alive connection each (so both see the same machine), a photo-sized body each.

    python -m perf.head_bound --out perf/results/torchserve-head-bound-ab.json"""
from __future__ import annotations

import asyncio
import http.client
import statistics
import sys
import threading
import time
from pathlib import Path

from common.cli import OneLineParser, write_result
from common.procs import free_port


async def app(scope, receive, send):
    """Reads the whole body, answers its length: what the front does before a prediction is queued."""
    if scope["type"] != "http":
        return
    size, more = 0, True
    while more:
        message = await receive()
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    body = str(size).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def serve(protocol) -> int:
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, http=protocol, log_level="warning",
                                           access_log=False, lifespan="off"))
    threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True).start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    return port


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m perf.head_bound", description=__doc__)
    p.add_argument("--requests", type=int, default=3000, help="per protocol. Default: 3000.")
    p.add_argument("--body-kb", type=int, default=100, help="each request's body. Default: 100 (a photo).")
    p.add_argument("--out", type=Path, help="JSON to write. Default: print only.")
    args = p.parse_args(argv)

    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from perf.bench import machine
    from server.torchserve.bounded_http import BoundedHttpToolsProtocol

    variants = {"uvicorn": HttpToolsProtocol, "bounded": BoundedHttpToolsProtocol}
    connections = {name: http.client.HTTPConnection("127.0.0.1", serve(protocol)) for name, protocol in variants.items()}
    body, times = b"x" * (args.body_kb << 10), {name: [] for name in variants}
    for index in range(args.requests + 100):
        for name in (variants if index % 2 else reversed(list(variants))):
            began = time.perf_counter()
            connections[name].request("POST", "/predictions/m", body, {"Content-Type": "image/jpeg"})
            reply = connections[name].getresponse()
            assert reply.status == 200 and int(reply.read()) == len(body)
            if index >= 100:  # warm-up
                times[name].append((time.perf_counter() - began) * 1000)
    figures = {}
    for name, measured in times.items():
        measured.sort()
        figures[name] = {"p50_ms": round(statistics.median(measured), 4),
                         "p99_ms": round(measured[int(0.99 * len(measured))], 4)}
    result = {"command": "python -m perf.head_bound " + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": machine(), "requests_per_protocol": args.requests, "body_bytes": len(body), **figures,
              "added_p50_ms": round(figures["bounded"]["p50_ms"] - figures["uvicorn"]["p50_ms"], 4)}
    print(write_result(result, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
