"""Tune batching live on a running server (explicit model control) for a load and a p99 budget."""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import tritonclient.http as httpclient

from common.cli import OneLineParser
from builder import config as cfg
from common.modelconfig import from_json, instance_count, to_text
from perf import loadgen
from clients.classify import model_config
from common.messages import first_line


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m perf.tune", description=__doc__)
    p.add_argument("--url", default="127.0.0.1:8000", help="server HTTP address. Default: 127.0.0.1:8000.")
    p.add_argument("--model", default="resnet152", help="model to tune. Default: resnet152.")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, default=None, help="closed-loop clients. Default: 8.")
    load.add_argument("--rate", type=float, default=None, help="requests per second offered instead. Default: unset.")
    p.add_argument("--p99-ms", type=float, default=None, help="latency budget (p99). Default: none: best throughput.")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[0, 4, 8, 16],
                   help="max batch sizes to try (0 = unbatched). Default: 0 4 8 16.")
    p.add_argument("--delays-us", type=int, nargs="+", default=[0, 5000, 20000],
                   help="max queue delays to try. Default: 0 5000 20000.")
    p.add_argument("--instances", type=int, nargs="+", default=[1], help="instance counts to try. Default: 1.")
    p.add_argument("--seconds", type=float, default=10.0, help="measurement per candidate. Default: 10.")
    p.add_argument("--output", type=Path, default=None,
                   help="where to write the chosen config.pbtxt. Default: tuned-MODEL.pbtxt (none with "
                        "--reconfigure).")
    p.add_argument("--reconfigure", action="store_true",
                   help="apply --batch-size/--max-batch-delay-ms live and stop (TorchServe's POST /models"
                        "?batch_size=..&max_batch_delay=..). Default: off.")
    p.add_argument("--batch-size", type=int, default=None, help="with --reconfigure: max batch size.")
    p.add_argument("--max-batch-delay-ms", type=float, default=None, help="with --reconfigure: delay in ms.")
    p.add_argument("--instance-count", type=int, default=None, help="with --reconfigure: instances. Default: keep.")
    return p


def candidate(base: dict, size: int, delay_us: int, instances: int) -> dict:
    """The served config with new batching, validated by the builder's rules before Triton sees it."""
    cfg.Batching(size, delay_us).validate()
    if instances < 1:
        raise cfg.ConfigError(f"`instance_group.count` must be >= 1, got {instances}")
    return loadgen.batching_override(base, size, delay_us, instances)


def pick(points: list[tuple[tuple[int, int, int], loadgen.Point]], p99_ms: float | None):
    """Highest throughput within the budget (no errors); if none fits, the lowest p99."""
    clean = [(key, p) for key, p in points if p.errors == 0 and p.throughput == p.throughput]
    fits = [(key, p) for key, p in clean if p99_ms is None or p.p99_ms <= p99_ms]
    if fits:
        return max(fits, key=lambda kp: kp[1].throughput), True
    return min(clean or points, key=lambda kp: kp[1].p99_ms), False


def table(points, best_key) -> str:
    rows = [f"{'':2}{'max_batch':>9} {'delay_us':>9} {'inst':>4} {'img/s':>8} {'p50 ms':>8} {'p99 ms':>8} "
            f"{'avg batch':>9} {'errors':>6}"]
    for key, p in points:
        mark = "* " if key == best_key else "  "
        rows.append(f"{mark}{key[0]:>9} {key[1]:>9} {key[2]:>4} {p.throughput:>8.2f} {p.p50_ms:>8.1f} "
                    f"{p.p99_ms:>8.1f} {p.avg_batch:>9.2f} {p.errors:>6}")
    return "\n".join(rows)


def write(config: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_text(from_json(config)))
    return path


def reconfigure(client, model: str, base: dict, args) -> dict:
    size = args.batch_size if args.batch_size is not None else int(base.get("max_batch_size", 0))
    delay_ms = args.max_batch_delay_ms
    delay = round(delay_ms * 1000) if delay_ms is not None else int(
        base.get("dynamic_batching", {}).get("max_queue_delay_microseconds", 0))
    instances = args.instance_count or instance_count(from_json(base))
    config = candidate(base, size, delay, instances)
    loadgen.load_with(client, model, config)
    print(f"{model}: max_batch_size={size} max_queue_delay_microseconds={delay} instances={instances} (live)")
    return config


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    client = httpclient.InferenceServerClient(args.url, network_timeout=600)
    try:
        if not client.is_model_ready(args.model):
            raise RuntimeError(f"model {args.model!r} is not ready on {args.url}")
        base = model_config(client, args.model)
        if args.reconfigure:
            config = reconfigure(client, args.model, base, args)
            if args.output:
                print(f"wrote {write(config, args.output)}")
            return 0
        return search(client, base, args)
    except cfg.ConfigError as exc:
        print(f"tune: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # tritonclient errors: show the server's reason in one line
        message = first_line(exc, type(exc).__name__)
        if "restricted" in message:
            message += " (start the server with `serve-repo --model-control explicit`)"
        print(f"tune: error: {message}", file=sys.stderr)
        return 1


def search(client, base: dict, args) -> int:
    concurrency = args.concurrency or (16 if args.rate else 8)
    side = int(base["input"][0]["dims"][-1])
    grid = [(size, 0 if size == 0 else delay, inst) for size, delay, inst
            in itertools.product(args.batch_sizes, args.delays_us, args.instances)]
    grid = list(dict.fromkeys(grid))  # unbatched ignores the delay: try it once per instance count
    points = []
    try:
        for size, delay, inst in grid:
            loadgen.load_with(client, args.model, candidate(base, size, delay, inst))
            image = loadgen.sample(side, batched=size > 0)
            point = loadgen.run_load(args.url, args.model, concurrency, args.seconds, image,
                                     label=f"b{size} d{delay} i{inst}", rate=args.rate)
            points.append(((size, delay, inst), point))
            print(f"  b{size:<3} d{delay:<6} i{inst}: {point.throughput:6.2f} img/s, p99 {point.p99_ms:8.1f} ms",
                  file=sys.stderr, flush=True)
    finally:
        loadgen.load_with(client, args.model, base)
    (best_key, best), fits = pick(points, args.p99_ms)
    load = f"rate {args.rate}/s" if args.rate else f"concurrency {concurrency}"
    print(f"{args.model} under {load}, p99 budget {args.p99_ms or 'none'} ms:")
    print(table(points, best_key))
    if not fits:
        print(f"no candidate met p99 <= {args.p99_ms} ms; * marks the lowest p99")
    winner = candidate(base, *best_key)
    print(f"wrote {write(winner, args.output or Path(f'tuned-{args.model}.pbtxt'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
