"""What serve-repo's canary (server/canary.py) costs: time to "ready" with --canary on and off, alternated, and a dead
stub's replacement (kill -9 of the classifier's stub until the supervisor logs "ready again") with each.

    python -m perf.canary --repository /tmp/repo --rounds 3 --out perf/results/canary-resnet18.json
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import time
from pathlib import Path

from common.cli import OneLineParser
from perf.serve import ServeRepo
from server.procfs import stubs_of


def started(repository: Path, canary: str) -> tuple[float, ServeRepo]:
    began = time.monotonic()
    serve = ServeRepo(repository, "--canary", canary)
    return time.monotonic() - began, serve


def replaced(serve: ServeRepo, model: str) -> float:
    """kill -9 one stub of `model`; the supervisor's own figure for its replacement, canary included when on."""
    stub = next(s for s in stubs_of(serve.triton_pid) if s.model == model and s.alive)
    mark = len(serve.lines)
    os.kill(stub.pid, signal.SIGKILL)
    line = serve.wait_for(f"{model}: ready again after", 300, mark)
    return float(re.search(r"ready again after ([\d.]+)s", line).group(1))


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m perf.canary", description=__doc__)
    p.add_argument("--repository", type=Path, required=True, help="a built repository. Default: none (required).")
    p.add_argument("--model", default="resnet18", help="the model whose stub is killed. Default: resnet18.")
    p.add_argument("--rounds", type=int, default=3, help="starts (and replacements) per setting. Default: 3.")
    p.add_argument("--out", type=Path, help="JSON result file. Default: none (printed only).")
    args = p.parse_args(argv)
    runs: dict[str, dict[str, list[float]]] = {s: {"ready_s": [], "replacement_s": []} for s in ("off", "on")}
    canary_lines = []
    for _ in range(args.rounds):
        for setting in ("off", "on"):  # alternated: a neighbour's load weighs on both alike
            seconds, serve = started(args.repository, setting)
            try:
                runs[setting]["ready_s"].append(round(seconds, 2))
                canary_lines += [line for line in serve.lines if line.startswith("canary:")]
                time.sleep(2)  # idle, as the drills' replacements are
                runs[setting]["replacement_s"].append(replaced(serve, args.model))
            finally:
                serve.stop()
    result = {"command": "python -m perf.canary " + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": f"{os.cpu_count()} cores", "runs": runs, "canary_lines": canary_lines,
              "median": {s: {k: statistics.median(v) for k, v in r.items()} for s, r in runs.items()}}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
