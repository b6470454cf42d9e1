"""Soak: mixed traffic (drills.mixed) for a fixed time while recording the memory of tritonserver and of
each stub (RSS) and the python backend's shared memory in /dev/shm; writes JSON and a plot. With
--kill-every, the server is supervised as serve-repo runs it and a stub (the model's, then the
preprocess one's, in turn) is killed every so many seconds: each recovery is timed, and every failed
request must fall inside a fault's window (from the kill to its recovery plus the queue timeout).

    python -m drills.soak --minutes 30 --kill-every 180 --out drills/results/soak-faults-resnet18
"""
from __future__ import annotations

import itertools
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import names
from common.cli import OneLineParser
from drills.loadtest import SEED, build_small_repo, served_transform
from drills.mixed import Sender, Tally, build_cases, process_memory, reference_for, schedule
from perf.load import closed_loop

MB = 1 << 20
HANG_LIMIT = 60.0  # seconds: a request without an answer by then counts as hung (the queue timeout is 10 s)
WINDOW_SLACK = 10.0  # a fault's window: kill .. recovery + this (requests queued behind it may time out)


def shm_bytes(prefix: str) -> int:
    total = 0
    for region in Path("/dev/shm").glob(f"{prefix}*"):
        try:
            total += region.stat().st_blocks * 512  # what is really allocated, not the sparse size
        except OSError:
            pass
    return total


def sample(server, tally: Tally, started: float) -> dict:
    stubs, stubs_anon = {}, {}
    for stub in server.stubs():
        if stub.alive:
            stubs[stub.model] = stubs.get(stub.model, 0) + process_memory(stub.pid)
            stubs_anon[stub.model] = stubs_anon.get(stub.model, 0) + process_memory(stub.pid, "RssAnon")
    return {"t": round(time.monotonic() - started, 1), "tritonserver_rss": process_memory(server.pid),
            "tritonserver_anon": process_memory(server.pid, "RssAnon"), "stubs_rss": stubs,
            "stubs_anon": stubs_anon, "shm": shm_bytes(server.shm_prefix), "requests": tally.total(),
            "good_correct": tally.total("ok")}


def growth(samples: list[dict], key, warmup: float) -> dict:
    """Mean over the first minute after warm-up vs the last minute, in MB, and per hour of the span."""
    values = [(s["t"], key(s)) for s in samples if s["t"] >= warmup]
    first = [v for t, v in values if t < values[0][0] + 60]
    last = [v for t, v in values if t > values[-1][0] - 60]
    start, end = sum(first) / len(first), sum(last) / len(last)
    hours = max((values[-1][0] - values[0][0] - 60) / 3600, 1e-9)
    return {"start_mb": round(start / MB, 1), "end_mb": round(end / MB, 1),
            "growth_mb": round((end - start) / MB, 1), "growth_mb_per_hour": round((end - start) / MB / hours, 1),
            "max_mb": round(max(v for _, v in values) / MB, 1)}


def plot(samples: list[dict], models: list[str], path: Path, kills: list[float] = ()) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t"] / 60 for s in samples]
    fig, (mem, rate) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    mem.plot(t, [s["tritonserver_rss"] / MB for s in samples], label="tritonserver RSS")
    mem.plot(t, [s["tritonserver_anon"] / MB for s in samples], "--", label="tritonserver anonymous")
    for model in models:
        mem.plot(t, [s["stubs_rss"].get(model, 0) / MB for s in samples], label=f"stub {model} RSS")
        mem.plot(t, [s["stubs_anon"].get(model, 0) / MB for s in samples], "--", label=f"stub {model} anonymous")
    mem.plot(t, [s["shm"] / MB for s in samples], label="/dev/shm (python backend)")
    mem.set_ylabel("MB")
    mem.legend(loc="center right", fontsize=7)
    mem.grid(alpha=0.3)
    done = [s["requests"] for s in samples]
    rate.plot(t[1:], [(b - a) / max(tb - ta, 1e-9) / 60 for a, b, ta, tb in zip(done, done[1:], t, t[1:])])
    for axis in (mem, rate):
        for at in kills:
            axis.axvline(at, color="red", alpha=0.3, linewidth=1)
    rate.set_ylabel("requests/s")
    rate.set_xlabel("minutes")
    rate.grid(alpha=0.3)
    fig.suptitle("Soak: mixed good/bad requests, both models, HTTP+gRPC"
                 + (f"; a stub killed at each red line ({len(kills)})" if kills else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m drills.soak", description=__doc__)
    p.add_argument("--model", default="resnet18", help="Default: resnet18.")
    p.add_argument("--minutes", type=float, default=10, help="Default: 10.")
    p.add_argument("--concurrency", type=int, default=8, help="Default: 8.")
    p.add_argument("--every", type=float, default=5, help="seconds between memory samples. Default: 5.")
    p.add_argument("--warmup", type=float, default=60, help="seconds left out of the growth figure. Default: 60.")
    p.add_argument("--out", type=Path, default=Path("drills/results/soak"),
                   help="writes OUT.json and OUT.png. Default: drills/results/soak.")
    p.add_argument("--kill-every", type=float, default=0,
                   help="seconds between stub kills (kill -9), the supervisor bringing them back; 0: none. "
                        "Default: 0.")
    args = p.parse_args(argv)

    from server.supervisor import Supervisor
    from server.triton import TritonServer

    models = [args.model, names.named(args.model, "preprocess")]
    supervised = []  # (seconds since start, line) from the supervisor
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        repo = build_small_repo(args.model, Path(tmp))
        with TritonServer.local(repo) as server:
            cases = build_cases(args.model, reference_for(args.model, SEED),
                                served_transform(server.http_url, args.model))
            tally, stop, timed = Tally(), threading.Event(), []
            started = time.monotonic()
            samples = [sample(server, tally, started)]
            supervisor = Supervisor(server, log=lambda line: supervised.append(
                (round(time.monotonic() - started, 2), line)))

            def connect(index: int):  # one closed-loop client of perf.load: its own endless mix of cases
                sender = Sender(server.http_url, server.grpc_url, tally, timeout=HANG_LIMIT)
                mix = (case for rounds in itertools.count() for case in schedule(cases, 100, seed=index * 100_003 + rounds))

                def send():
                    case, sent = next(mix), time.monotonic() - started
                    outcome = sender.send(case)
                    timed.append((sent, time.monotonic() - started, case.good, outcome))

                return send, sender.close

            def observe():  # samples memory; kills a stub every --kill-every seconds
                kills, deadline = [], started + args.minutes * 60
                next_kill = started + args.kill_every if args.kill_every else float("inf")
                while time.monotonic() < deadline:
                    time.sleep(max(0.0, min(args.every, deadline - time.monotonic(), next_kill - time.monotonic())))
                    if time.monotonic() >= next_kill and deadline - time.monotonic() < 30:
                        next_kill = float("inf")  # no kill whose recovery the run would not see
                    if time.monotonic() >= next_kill:
                        model = models[len(kills) % len(models)]
                        stub = next((s for s in server.stubs() if s.model == model and s.alive), None)
                        if stub is not None:
                            os.kill(stub.pid, signal.SIGKILL)
                            kills.append({"t": round(time.monotonic() - started, 2), "model": model})
                        next_kill += args.kill_every
                        continue
                    samples.append(sample(server, tally, started))
                    print(f"{samples[-1]['t']:7.0f}s  requests {samples[-1]['requests']:7d}  tritonserver "
                          f"{samples[-1]['tritonserver_rss'] / MB:7.1f} MB  shm {samples[-1]['shm'] / MB:6.1f} MB  "
                          f"kills {len(kills)}", flush=True)
                stop.set()
                observed.extend(kills)

            observed: list[dict] = []
            threads = [threading.Thread(target=closed_loop, args=(connect, args.concurrency, args.minutes * 60)),
                       threading.Thread(target=observe)]
            for thread in threads:
                thread.start()
            status = supervisor.run(stop)  # in this thread, which started the server (see Supervisor)
            for thread in threads:
                thread.join()
            ready_after = server.ready() and all(server.model_ready(m) for m in models)
    faults = recoveries(observed, supervised)
    windows = [(f["t"], f["t"] + (f["ready_again_after_s"] or 1e9) + WINDOW_SLACK) for f in faults]
    failed = [(sent, done) for sent, done, good, outcome in timed if good and outcome != "ok"]
    summary = {
        "model": args.model, "minutes": args.minutes, "concurrency": args.concurrency,
        "kill_every_s": args.kill_every, "requests": tally.total(), "good_correct": tally.total("ok"),
        "bad_refused": tally.total("refused"), "wrong_answers": tally.total("wrong"),
        "good_failed": tally.total("error"), "bad_accepted": tally.total("accepted-bad"),
        "hung": sum(1 for sent, done, _, _ in timed if done - sent >= HANG_LIMIT - 0.5),
        "good_failed_outside_fault_windows": sum(1 for sent, done in failed
                                                 if not any(a <= done and sent <= b for a, b in windows)),
        "longest_request_s": round(max((done - sent for sent, done, _, _ in timed), default=0.0), 2),
        "faults": faults, "supervisor_status": status, "server_ready_after": ready_after,
        "growth_after_warmup": {
            "tritonserver": growth(samples, lambda s: s["tritonserver_rss"], args.warmup),
            "tritonserver (anonymous)": growth(samples, lambda s: s["tritonserver_anon"], args.warmup),
            **{f"stub {m}": growth(samples, lambda s, m=m: s["stubs_rss"].get(m, 0), args.warmup) for m in models},
            **{f"stub {m} (anonymous)": growth(samples, lambda s, m=m: s["stubs_anon"].get(m, 0), args.warmup)
               for m in models},
            "shm": growth(samples, lambda s: s["shm"], args.warmup),
        },
        "examples": tally.examples, "supervisor_log": [f"{t:8.2f}s {line}" for t, line in supervised],
        "samples": samples,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
    plot(samples, models, args.out.with_suffix(".png"), [f["t"] / 60 for f in faults])
    print(json.dumps({k: v for k, v in summary.items() if k not in ("samples", "supervisor_log")}, indent=2))
    ok = (summary["wrong_answers"] == summary["bad_accepted"] == summary["hung"] == 0 and ready_after
          and summary["good_failed_outside_fault_windows"] == 0 and (args.kill_every or summary["good_failed"] == 0))
    return 0 if ok else 1


def recoveries(kills: list[dict], supervised: list[tuple[float, str]]) -> list[dict]:
    """Each kill with the seconds until the supervisor said its model was ready again."""
    found = []
    for kill in kills:
        back = [t for t, line in supervised if t >= kill["t"] and f"{kill['model']}: ready again" in line]
        found.append({**kill, "ready_again_after_s": round(back[0] - kill["t"], 2) if back else None})
    return found


if __name__ == "__main__":
    sys.exit(main())
