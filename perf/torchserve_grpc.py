"""TorchServe's gRPC Predictions served on Triton against TorchServe 0.12's own, one sitting (issue 45).

One ResNet-152 archive (torchvision, random weights seed 0, TorchServe's image_classifier handler), registered
through each server's management API with the seed walkthrough's values (batch_size=8, max_batch_delay=10,
initial_workers=1); one photo. Both servers are up the whole sitting; each is first warmed up (`--settle` seconds at
c=8 over both APIs, not measured: a model just registered, and the other server's start, make the first minutes
slower). Then rounds, each measuring on serve-repo's TorchServe front and on TorchServe 0.12 (the first server of a
round alternates, so that a drift in the machine's other load falls on both):
- c=1, gRPC against REST: one client sending its requests alternately over gRPC (`InferenceAPIsService.Predictions`,
  TorchServe's inference.proto, a channel of its own) and over REST (/predictions, a keep-alive HTTP connection),
  which one goes first alternating pair by pair: both APIs see the same machine, request by request, so that their
  difference is the API's, not the minute's;
- c=8 throughput: closed-loop clients (perf.torchserve_bench's), gRPC then REST (REST first in every other round).
The ratios are of the rounds' totals (images over seconds, latencies' medians); each round's own ratios are listed.

    python -m perf.torchserve_grpc                                              # 4 rounds of 25 s per measurement
    python -m perf.torchserve_grpc --rounds 1 --seconds 3 --warmup 1 --settle 2  # a quick look
"""
from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from common.cli import OneLineParser, write_result
from perf import load, torchserve
from perf.samples import CAT
from perf.serve import TorchServeFront
from perf.torchserve_api import _call, register
from perf.torchserve_bench import as_point, closed_loop, cpu, cpu_slug, rest_client, versions

NAME = "resnet152"


def grpc_client(address: str, model: str, body: bytes):
    """perf.load's connect calling Predictions on a channel of its own per client; send() -> the prediction."""
    import grpc

    from server.torchserve.proto import inference_pb2, inference_pb2_grpc

    request = inference_pb2.PredictionsRequest(model_name=model, input={"data": body})

    def connect(index: int = 0):
        channel = grpc.insecure_channel(address)
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
        return (lambda: stub.Predictions(request, timeout=300).prediction), channel.close

    return connect


def grpc_loop(address: str, model: str, body: bytes, concurrency: int, seconds: float, warmup: float) -> dict:
    """`concurrency` clients, each calling Predictions on a channel of its own when its last answer has come."""
    return as_point(load.closed_loop(grpc_client(address, model, body), concurrency, seconds, warmup=warmup), warmup,
                    json.loads)


def interleaved(rest_url: str, grpc_address: str, model: str, body: bytes, seconds: float, warmup: float) -> dict:
    """c=1 over both APIs from one client, request by request (perf.load.interleaved): gRPC then REST, REST then
    gRPC, and so on; each API's point of the measured window."""
    clients = {"grpc": grpc_client(grpc_address, model, body)(), "rest": rest_client(rest_url, model, body)()}
    try:
        found = load.interleaved({api: send for api, (send, _) in clients.items()}, seconds, warmup=warmup)
    finally:
        for _, close in clients.values():
            close()
    return {api: {**as_point(found[api], warmup), "interleaved_with": "rest" if api == "grpc" else "grpc"}
            for api in clients}


def measured(rest_url: str, grpc_address: str, body: bytes, level: int, args, rest_first: bool) -> dict:
    """One c=`level` point over gRPC and one over REST: c=1 interleaved; else gRPC first unless `rest_first`."""
    if level == 1:
        return interleaved(rest_url, grpc_address, NAME, body, args.seconds, args.warmup)
    ways = {"grpc": lambda: grpc_loop(grpc_address, NAME, body, level, args.seconds, args.warmup),
            "rest": lambda: closed_loop(rest_url, NAME, body, level, args.seconds, args.warmup)}
    return {api: ways[api]() for api in (("rest", "grpc") if rest_first else ("grpc", "rest"))}


def settled(servers: dict, body: bytes, seconds: float) -> None:
    """Each server at c=8 for `seconds`, half over gRPC, half over REST; nothing kept."""
    for name, (rest_url, grpc_address) in servers.items():
        grpc_loop(grpc_address, NAME, body, 8, seconds / 2, 0)
        closed_loop(rest_url, NAME, body, 8, seconds / 2, 0)
        print(f"  settled {name} ({seconds:.0f} s at c=8)", file=sys.stderr)


def rounds(servers: dict, body: bytes, args) -> list[dict]:
    """`args.rounds` rounds, each: every server at c=1 and c=8, gRPC and REST; which server comes first and which API
    comes first alternate from round to round (what follows another load measures slower: an even count of rounds
    gives both the same share)."""
    settled(servers, body, args.settle)
    done = []
    for index in range(args.rounds):
        order = list(servers) if index % 2 == 0 else list(servers)[::-1]
        found = {}
        for name in order:
            rest_url, grpc_address = servers[name]
            found[name] = {f"c{level}": measured(rest_url, grpc_address, body, level, args, rest_first=index % 2 == 1)
                           for level in (1, 8)}
            for level, point in found[name].items():
                print(f"  round {index + 1} {name} {level}: " + ", ".join(
                    f"{api} {p['images_per_s']} img/s p50 {p['p50_ms']} ms errors {p['errors']} load "
                    f"{p['loadavg_1min']}" for api, p in point.items()), file=sys.stderr)
        done.append(found)
    return done


def totals(done: list[dict], server: str, api: str) -> dict:
    """One server's figures over all rounds: c=8 images over the rounds' seconds, c=1 the median of the rounds'
    p50s; each round's points under "points"."""
    c8 = [found[server]["c8"][api] for found in done]
    c1 = [found[server]["c1"][api] for found in done]
    seconds = sum(point["seconds"] for point in c8)
    return {"c8_images_per_s": round(sum(point["requests"] for point in c8) / seconds, 3),
            "c1_p50_ms": round(float(np.median([point["p50_ms"] for point in c1])), 1),
            "errors": sum(point["errors"] for point in c8 + c1),
            "points": [{"c1": one, "c8": eight} for one, eight in zip(c1, c8)]}


def ratios(ours: dict, theirs: dict) -> dict:
    def ratio(a, b):
        return round(a / b, 3) if a and b else None

    return {"grpc_c8_ours_over_torchserve": ratio(ours["grpc"]["c8_images_per_s"], theirs["grpc"]["c8_images_per_s"]),
            "grpc_c1_p50_ours_over_torchserve": ratio(ours["grpc"]["c1_p50_ms"], theirs["grpc"]["c1_p50_ms"]),
            "rest_c8_ours_over_torchserve": ratio(ours["rest"]["c8_images_per_s"], theirs["rest"]["c8_images_per_s"]),
            "ours_grpc_over_rest_c8": ratio(ours["grpc"]["c8_images_per_s"], ours["rest"]["c8_images_per_s"]),
            "ours_grpc_minus_rest_c1_p50_ms": round(ours["grpc"]["c1_p50_ms"] - ours["rest"]["c1_p50_ms"], 2),
            "torchserve_grpc_minus_rest_c1_p50_ms": round(theirs["grpc"]["c1_p50_ms"] - theirs["rest"]["c1_p50_ms"],
                                                          2)}


def per_round(done: list[dict]) -> list[dict]:
    """Each round's own c=8 ratio of ours over TorchServe's, gRPC and REST."""
    return [{api: round(found["ours"]["c8"][api]["requests"] / max(found["torchserve"]["c8"][api]["requests"], 1), 3)
             for api in ("grpc", "rest")} for found in done]


def sitting(folder: Path, store: Path, archive: Path, body: bytes, args) -> dict:
    """Both servers started and registered, then the rounds."""
    front = TorchServeFront(folder / "ours", timeout=args.start_timeout, model_store=str(store),
                            enable_model_api="true", disable_token_authorization="true")
    try:
        registered = {"ours": register(front.management_url, NAME, args.start_timeout)}
        with torchserve.started(folder / "torchserve", archive, 1, args.start_timeout,
                                properties={"enable_model_api": "true"}) as server:
            _call("DELETE", f"{server.management_url}/models/{NAME}")  # loaded at start-up without batching
            registered["torchserve"] = register(server.management_url, NAME, args.start_timeout)
            done = rounds({"ours": (front.inference_url, f"127.0.0.1:{front.grpc_ports[0]}"),
                           "torchserve": (server.inference_url, server.grpc_inference)}, body, args)
    finally:
        front.stop()
    return {name: {"registered": registered[name], **{api: totals(done, name, api) for api in ("grpc", "rest")}}
            for name in ("ours", "torchserve")} | {"per_round_c8_ours_over_torchserve": per_round(done)}


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m perf.torchserve_grpc", description=__doc__)
    p.add_argument("--rounds", type=int, default=4, help="Default: 4.")
    p.add_argument("--seconds", type=float, default=25, help="per measurement. Default: 25.")
    p.add_argument("--warmup", type=float, default=5, help="seconds before each. Default: 5.")
    p.add_argument("--settle", type=float, default=60,
                   help="seconds of c=8 on each server before the first round, not measured. Default: 60.")
    p.add_argument("--start-timeout", type=float, default=900)
    p.add_argument("--out", type=Path, help="JSON to write. Default: perf/results/torchserve-grpc-CPU.json")
    args = p.parse_args(argv)
    commands = torchserve.executables()
    began = time.monotonic()
    machine = {"cpu": cpu(), **versions(commands["java"])}
    out = args.out or Path("perf/results") / f"torchserve-grpc-{cpu_slug(machine['cpu']['model'])}.json"
    body = CAT.read_bytes()
    result = {"machine": machine,
              "command": " ".join(["python -m perf.torchserve_grpc", *(sys.argv[1:] if argv is None else argv)]),
              "rounds": args.rounds, "seconds": args.seconds, "warmup_seconds": args.warmup,
              "settle_seconds": args.settle,
              "image": f"{CAT.name} ({len(body)} bytes)"}
    with tempfile.TemporaryDirectory(prefix="ts-grpc-bench-") as tmp:
        store = Path(tmp) / "model_store"
        archive = torchserve.resnet_archive(store, NAME, None, None, None, arch=NAME)
        result.update(sitting(Path(tmp), store, archive, body, args))
    result["ratios"] = found = ratios(result["ours"], result["torchserve"])
    result["targets"] = {
        "grpc_c8_ours_over_torchserve": {"target": ">= 1.15", "met": (found["grpc_c8_ours_over_torchserve"] or 0)
                                         >= 1.15},
        "ours_grpc_minus_rest_c1_p50_ms": {"target": "<= 2", "met": found["ours_grpc_minus_rest_c1_p50_ms"] <= 2}}
    result["took_s"] = round(time.monotonic() - began)
    print(json.dumps({"ratios": found}, indent=1), file=sys.stderr)
    write_result(result, out)
    print(f"wrote {out} ({result['took_s']} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
