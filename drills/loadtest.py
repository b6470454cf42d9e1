"""Mixed load: N requests (good and bad, both models, HTTP and gRPC) from C concurrent clients; every
request must get exactly one answer, good ones equal to in-process, bad ones a clear refusal.

    python -m drills.loadtest --requests 5000 --concurrency 40 --out drills/results/load-mixed-resnet18.json
"""
from __future__ import annotations

import json
import sys
import tempfile
import threading
from pathlib import Path

from common import names
from common.cli import OneLineParser
from perf.load import closed_loop
from perf.stats import counters
from drills.mixed import Sender, Tally, build_cases, reference_for, schedule

SEED = 0


def build_small_repo(model: str, into: Path, instances: int = 1) -> Path:
    """Random weights (seed SEED) in fp32: the drills compare answers with in-process torch within 1e-4."""
    from builder import cli as build_repo

    repo = into / "repo"
    status = build_repo.main(["--model", model, "--weights", "random", "--seed", str(SEED), "--output", str(repo),
                              "--kind", "cpu", "--instances", str(instances), "--precision", "fp32"])
    if status:
        raise SystemExit(f"build-repo failed ({status})")
    return repo


def served_transform(http_url: str, model: str):
    from clients.classify import connect, model_config, preprocess_for

    _, triton = connect(http_url, "http")
    return preprocess_for(model_config(triton, model))


def average_batches(http_url: str, models) -> dict:
    """Requests per execution for each model: above 1 means bad requests shared batches with good ones."""
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(http_url)
    found = {}
    for model in models:
        average = counters(client, model).avg_batch
        found[model] = round(average, 2) if average == average else 0  # NaN: the model never ran
    return found


def drive(sequence, http_url: str, grpc_url: str, concurrency: int, tally: Tally) -> float:
    """Send every case in `sequence` from `concurrency` closed-loop clients (perf.load); seconds taken."""
    cases, lock = iter(sequence), threading.Lock()

    def connect(index: int):
        sender = Sender(http_url, grpc_url, tally)

        def send():
            with lock:
                case = next(cases)
            sender.send(case)

        return send, sender.close

    return closed_loop(connect, concurrency, requests=len(sequence)).seconds


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m drills.loadtest", description=__doc__)
    p.add_argument("--model", default="resnet18", help="torchvision model, random weights (seed 0). Default: resnet18.")
    p.add_argument("--requests", type=int, default=5000, help="Default: 5000.")
    p.add_argument("--concurrency", type=int, default=40, help="Default: 40.")
    p.add_argument("--good-share", type=float, default=0.7, help="Default: 0.7.")
    p.add_argument("--out", type=Path, help="JSON summary to write.")
    args = p.parse_args(argv)

    from server.triton import TritonServer

    with tempfile.TemporaryDirectory(prefix="loadtest-") as tmp:
        repo = build_small_repo(args.model, Path(tmp))
        with TritonServer.local(repo) as server:
            cases = build_cases(args.model, reference_for(args.model, SEED),
                                served_transform(server.http_url, args.model))
            sequence = schedule(cases, args.requests, args.good_share)
            tally = Tally()
            seconds = drive(sequence, server.http_url, server.grpc_url, args.concurrency, tally)
            batches = average_batches(server.http_url, (args.model, names.named(args.model, "preprocess")))
            ready_after = server.ready() and all(server.model_ready(m) for m in (args.model, names.image_model(args.model)))
    good_sent = sum(c.good for c in sequence)
    summary = {
        "model": args.model, "requests": len(sequence), "concurrency": args.concurrency,
        "good_sent": good_sent, "bad_sent": len(sequence) - good_sent,
        "answered": tally.total(), "lost": len(sequence) - tally.total(),
        "good_correct": tally.total("ok"), "bad_refused": tally.total("refused"),
        "wrong_answers": tally.total("wrong"), "good_failed": tally.total("error"),
        "bad_accepted": tally.total("accepted-bad"),
        "worst_relative_error": tally.worst_error, "tolerance": 1e-4,
        "seconds": round(seconds, 1), "server_ready_after": ready_after,
        "average_batch": batches,
        "per_case": dict(sorted(tally.counts.items())), "examples": tally.examples,
    }
    passed = (summary["lost"] == 0 and summary["good_correct"] == good_sent
              and summary["bad_refused"] == len(sequence) - good_sent and ready_after)
    summary["passed"] = passed
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
