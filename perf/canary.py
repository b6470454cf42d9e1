"""What serve-repo's canary (server/canary.py) costs: time to "ready" with --canary on and off, alternated, and a dead
stub's replacement (kill -9 of the classifier's stub until the supervisor logs "ready again") with each, and the
canary's own seconds as its log lines give them (the start-up difference is within the noise of a shared machine).

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
from perf.bench import machine
from perf.serve import ServeRepo
from server.procfs import stubs_of


def started(repository: Path, canary: str) -> tuple[float, ServeRepo]:
    began = time.monotonic()
    serve = ServeRepo(repository, "--canary", canary)
    return time.monotonic() - began, serve


def canary_seconds(line: str) -> float | None:
    found = re.search(r"answered right \(([\d.]+)s\)", line)
    return float(found.group(1)) if found else None


def replaced(serve: ServeRepo, model: str) -> tuple[float, float | None]:
    """kill -9 one stub of `model`: the supervisor's own figure for its replacement (canary included when on), and
    the canary's share of it."""
    stub = next(s for s in stubs_of(serve.triton_pid) if s.model == model and s.alive)
    mark = len(serve.lines)
    os.kill(stub.pid, signal.SIGKILL)
    line = serve.wait_for(f"{model}: ready again after", 300, mark)
    return float(re.search(r"ready again after ([\d.]+)s", line).group(1)), canary_seconds(line)


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m perf.canary", description=__doc__)
    p.add_argument("--repository", type=Path, required=True, help="a built repository. Default: none (required).")
    p.add_argument("--model", default="resnet18", help="the model whose stub is killed. Default: resnet18.")
    p.add_argument("--rounds", type=int, default=3, help="starts (and replacements) per setting. Default: 3.")
    p.add_argument("--out", type=Path, help="JSON result file. Default: none (printed only).")
    args = p.parse_args(argv)
    runs: dict[str, dict[str, list]] = {s: {"ready_s": [], "replacement_s": []} for s in ("off", "on")}
    runs["on"].update(canary_at_start_s=[], canary_at_replacement_s=[])
    canary_lines, load = [], [os.getloadavg()[0]]
    for _ in range(args.rounds):
        for setting in ("off", "on"):  # alternated: a neighbour's load weighs on both alike
            seconds, serve = started(args.repository, setting)
            try:
                runs[setting]["ready_s"].append(round(seconds, 2))
                time.sleep(2)  # idle, as the drills' replacements are
                took, checked = replaced(serve, args.model)
                runs[setting]["replacement_s"].append(took)
                if setting == "on":
                    line = next(line for line in serve.lines if line.startswith("canary:"))
                    canary_lines.append(line)
                    runs["on"]["canary_at_start_s"].append(canary_seconds(line))
                    runs["on"]["canary_at_replacement_s"].append(checked)
            finally:
                serve.stop()
        load.append(os.getloadavg()[0])
    result = {"command": "python -m perf.canary " + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": machine(), "load_average_1min": load, "runs": runs, "canary_lines": canary_lines[:1],
              "median": {s: {k: statistics.median(v) for k, v in r.items()} for s, r in runs.items()}}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
