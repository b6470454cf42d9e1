"""Hostile clients against both fronts (issue 42), each attack while an honest client sends one request at a time:

    python -m drills.hostile --out drills/results/hostile-resnet18.json

Front (a): serve-repo --proxy on (HAProxy + guard) serving resnet18; front (b): the TorchServe API serving a resnet18
archive. Per attack: the honest client's p50/p99 in the seconds before and during it, its failed requests, the
peak memory of tritonserver, its stubs, serve-repo and HAProxy during it over their peak before it, tritonserver
restarts (its pid), and what the attacker was answered. The attacker runs on the same 2 cores as the server and
the honest client, so the p99 ratio includes the attacker's own CPU."""
from __future__ import annotations

import json
import sys
import tempfile
import threading
import urllib.request
from collections import Counter
from pathlib import Path

import psutil

from common.cli import OneLineParser, write_result
from drills.attacks import proxy_attacks, torchserve_attacks
from drills.faults import image
from perf.load import closed_loop
from perf.samples import CAT
from perf.serve import ServeRepo, TorchServeFront


class Memory(threading.Thread):
    """Peak RSS (MB) per group of serve-repo's process tree, sampled every 50 ms until stopped."""

    def __init__(self, root: int):
        super().__init__(daemon=True)
        self.root, self.peaks, self.done = psutil.Process(root), Counter(), threading.Event()

    def run(self):
        while not self.done.wait(0.05):
            now = Counter()
            try:
                now["serve_repo"] = self.root.memory_info().rss
                for child in self.root.children(recursive=True):
                    group = {"tritonserver": "tritonserver", "haproxy": "haproxy"}.get(child.name(), "stubs")
                    now[group] += child.memory_info().rss
            except psutil.Error:
                continue
            for group, rss in now.items():
                self.peaks[group] = max(self.peaks[group], rss)

    def stop(self) -> dict:
        self.done.set()
        self.join()
        return {group: round(rss / 2**20) for group, rss in sorted(self.peaks.items())}


def honest_window(send, seconds: float) -> dict:
    """The honest client (perf.load, one request at a time) for `seconds`: answered, failed by kind, p50/p99."""
    found = closed_loop(lambda index: (send, lambda: None), 1, seconds)
    failures = Counter(s.error.splitlines()[0][:120] for s in found.samples if s.error)
    point = found.summary()
    return {"answered": point["requests"], "failed": point["errors"], "failures": dict(failures),
            "p50_ms": point.get("p50_ms") and round(point["p50_ms"], 1),
            "p99_ms": point.get("p99_ms") and round(point["p99_ms"], 1)}


def measure(name: str, serve: ServeRepo, honest, attack, seconds: float) -> dict:
    """The honest client alone for `seconds`, then with `attack` running; memory peaks of each window."""
    pid = serve.triton_pid
    memory = Memory(serve.process.pid)
    memory.start()
    before = honest_window(honest, seconds)
    before_peak = memory.stop()
    stop, outcome = threading.Event(), {}
    attacker = threading.Thread(target=lambda: outcome.update(attack(stop)), daemon=True)
    memory = Memory(serve.process.pid)
    memory.start()
    attacker.start()
    during = honest_window(honest, seconds)
    stop.set()
    attacker.join(60)
    during_peak = memory.stop()
    after = honest_window(honest, 2)
    try:
        restarted = serve.triton_pid != pid
    except AssertionError:
        restarted = True
    result = {"attack": name, "honest_before": before, "honest_during": during, "honest_after": after,
              "p99_ratio": round(during["p99_ms"] / before["p99_ms"], 2) if before["p99_ms"] and during["p99_ms"]
              else None, "peak_mb_before": before_peak, "peak_mb_during": during_peak,
              "peak_growth_mb": {g: during_peak.get(g, 0) - before_peak.get(g, 0) for g in during_peak},
              "tritonserver_restarted": restarted, "attacker": outcome}
    print(json.dumps(result), flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m drills.hostile", description=__doc__)
    p.add_argument("--model", default="resnet18", help="Default: resnet18 (random weights).")
    p.add_argument("--seconds", type=float, default=10, help="per window (honest alone, then attacked). Default: 10.")
    p.add_argument("--only", default="", help="comma-separated attack names (default: all).")
    p.add_argument("--out", type=Path, help="JSON to write. Default: print only.")
    args = p.parse_args(argv)

    import tritonclient.http as httpclient

    from drills.loadtest import build_small_repo
    from perf import torchserve
    from perf.bench import machine

    only = {name for name in args.only.split(",") if name}
    results: dict = {"command": "python -m drills.hostile " + " ".join(argv if argv is not None else sys.argv[1:]),
                     "model": args.model, "machine": machine(), "seconds_per_window": args.seconds, "attacks": []}
    with tempfile.TemporaryDirectory(prefix="hostile-drill-") as tmp:
        serve = ServeRepo(build_small_repo(args.model, Path(tmp), 1), "--proxy", "on")
        try:
            client = httpclient.InferenceServerClient(f"127.0.0.1:{serve.ports[0]}", network_timeout=60)
            tensor = httpclient.InferInput("IMAGE", [1, 3, 224, 224], "FP32")
            tensor.set_data_from_numpy(image(0))
            for name, attack in proxy_attacks(serve, args.model).items():
                if not only or name in only:
                    run = measure(name, serve, lambda: client.infer(args.model, [tensor]), attack, args.seconds)
                    results["attacks"].append({"front": "proxy", **run})
        finally:
            serve.stop()
        store = Path(tmp) / "store"
        torchserve.resnet_archive(store, args.model, 8, 5, 1, arch=args.model, fc_scale=0.01)
        front = TorchServeFront(Path(tmp) / "front", model_store=str(store), load_models=f"{args.model}.mar",
                                disable_token_authorization="true", enable_model_api="true",
                                allowed_urls=r"http://127\.0\.0\.1:[0-9]+/.*")
        try:
            photo = CAT.read_bytes()
            url = f"http://127.0.0.1:{front.ports[0]}/predictions/{args.model}"

            def honest():
                with urllib.request.urlopen(urllib.request.Request(url, data=photo), timeout=60) as reply:
                    reply.read()

            for name, attack in torchserve_attacks(front, args.model).items():
                if not only or name in only:
                    results["attacks"].append({"front": "torchserve", **measure(name, front, honest, attack,
                                                                                args.seconds)})
        finally:
            front.stop()
    write_result(results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
