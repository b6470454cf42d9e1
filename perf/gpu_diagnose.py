"""Everything the next GPU session needs to learn, in one bounded call: python -m perf.gpu_diagnose OUTDIR.

Each step runs in a process of its own (python -m perf.gpu_steps) under a time limit, so that a crash
or a hang in CUDA ends that step only. Its outcome -- ok, failed with a reason, or skipped with a
reason -- and what it learned go to OUTDIR/diagnose.json, rewritten after every step (a call cut short
keeps what was learned); each step's log (STEP.log) and each tritonserver's log sit beside it.
Where torch sees no CUDA the GPU steps are skipped, with that reason.

Steps, in this order by default:
  environment           Python/torch/torchvision/CUDA versions, GPU, CPU model, how libcuda resolves
                        (ldconfig, dlopen of libcuda.so and libcuda.so.1), ldd of the wheel's python stub
  gpu_output            an echo model on a GPU instance answering with a torch CUDA tensor, one request:
                        as is, then with libcuda.so -> libcuda.so.1 first on tritonserver's LD_LIBRARY_PATH
  image_path            a JPEG to resnet18_image (random weights) over gRPC: the fused model (the GPU
                        default), the ensemble with CPU preprocess, then with --decode-device gpu (and, if
                        that fails, variants that tell decode from GPU output)
  parity                nvJPEG + GPU transforms vs PIL on perf.samples' JPEGs
  gpu_tests             pytest tests/test_gpu.py tests/test_gpu_options.py tests/test_preprocess_gpu.py
                        tests/test_handler_gpu.py
  python_backend_probe  echo models (CPU, GPU instance) vs resnet18 fp16, served img/s at c=1 and 64

On the bare GPU machine (no package registry; the wheels travel with the tree, e.g. in .whl/):
  tools/unpack_wheels.sh .whl /tmp/site && PYTHONPATH=/tmp/site:$PWD python3 -m perf.gpu_diagnose $OUT/diagnose

Exit status: 0 when no step failed, 1 when one did (diagnose.json says which and why), 2 for bad arguments.
"""
from __future__ import annotations

import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from common.cli import OneLineParser
from perf.gpu_steps import ROOT, STEPS, result_path, run_bounded

GRACE_S = 20  # after SIGTERM, time for a step to stop its servers and write what it has
MIN_STEP_S = 15  # less than this left in the budget (and asked for): the step is skipped rather than started
# Run in a child so that a CUDA driver that hangs or crashes on init cannot take this process with it.
_CUDA_PROBE = ("import json, torch; ok = torch.cuda.is_available(); print(json.dumps({'available': ok, "
               "'devices': torch.cuda.device_count() if ok else 0, 'torch': torch.__version__}))")


def parser() -> OneLineParser:
    p = OneLineParser(prog="python -m perf.gpu_diagnose", description=__doc__.split("\n\n")[0])
    p.add_argument("outdir", type=Path, help="folder for diagnose.json and the logs (created). Default: none "
                                             "(required).")
    p.add_argument("--steps", nargs="+", choices=list(STEPS), default=list(STEPS), metavar="STEP",
                   help=f"steps to run, in the order given ({', '.join(STEPS)}). Default: all of them.")
    p.add_argument("--timeout-s", type=float, default=240,
                   help="longest one step may run, in seconds: then it gets SIGTERM, and SIGKILL to its process "
                        f"group {GRACE_S} s later, and is recorded as failed. Default: 240.")
    p.add_argument("--budget-s", type=float, default=520,
                   help="all steps together, in seconds (a device call is limited to 600): a step gets at most "
                        "what is left, and is skipped when too little is. Default: 520.")
    return p


def probe_cuda(out: Path) -> dict:
    log = out / "cuda_probe.log"
    status = run_bounded([sys.executable, "-c", _CUDA_PROBE], log, 120, grace=5, cwd=ROOT)
    lines = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
    try:
        found = json.loads(lines[-1])
    except (IndexError, ValueError):
        tail = lines[-1][:300] if lines else "no output"
        return {"available": False, "error": f"the probe {'timed out' if status is None else 'failed'}: {tail}",
                "reason": "no CUDA: the probe failed (cuda_probe.log)"}
    if not found["available"]:
        found["reason"] = f"no CUDA: torch.cuda.is_available() is False (torch {found['torch']})"
    return found


def run_step(step: str, out: Path, limit: float) -> dict:
    """One step in a child process, bounded: its own outcome, or failed with why it gave none."""
    result_path(out, step).unlink(missing_ok=True)
    begin = time.monotonic()
    status = run_bounded([sys.executable, "-m", "perf.gpu_steps", step, str(out), "--timeout-s", f"{limit:g}"],
                         out / f"{step}.log", limit, grace=GRACE_S, cwd=ROOT)
    try:
        outcome = json.loads(result_path(out, step).read_text())
        result_path(out, step).unlink()
    except (OSError, ValueError):
        outcome = {"status": "failed", "details": {}}
        if status is not None:  # it died before writing: a crash (a negative status is the killing signal)
            outcome["reason"] = f"the step's process exited with status {status} and no result; see {step}.log"
    if status is None:
        outcome.update(status="failed", reason=f"timed out after {limit:g} s")
    outcome.update(seconds=round(time.monotonic() - begin, 1), log=f"{step}.log")
    return outcome


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    out: Path = args.outdir
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"gpu_diagnose: cannot create {out}: {exc.strerror}", file=sys.stderr)
        return 2
    deadline = time.monotonic() + args.budget_s
    report = {"command": " ".join(["python -m perf.gpu_diagnose", *(sys.argv[1:] if argv is None else argv)]),
              "started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "cuda": {}, "steps": {}}

    def save() -> None:
        (out / "diagnose.json").write_text(json.dumps(report, indent=2, default=str) + "\n")

    cuda = report["cuda"] = probe_cuda(out)
    save()
    for step in args.steps:
        left = deadline - time.monotonic() - GRACE_S
        if STEPS[step][2] and not cuda["available"]:
            outcome = {"status": "skipped", "reason": cuda["reason"]}
        elif left < min(args.timeout_s, MIN_STEP_S):
            outcome = {"status": "skipped", "reason": f"no time left in --budget-s {args.budget_s:g}"}
        else:
            outcome = run_step(step, out, min(args.timeout_s, left))
        report["steps"][step] = outcome
        save()
        print(f"{step}: {outcome['status']}" + (f" ({outcome['reason']})" if outcome.get("reason") else ""),
              flush=True)
    report["finished"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    save()
    print(f"wrote {out / 'diagnose.json'}")
    failed = "error" in cuda or any(o["status"] == "failed" for o in report["steps"].values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
