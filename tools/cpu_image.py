"""The CPU image (docker/Dockerfile.cpu) in one command: podman, buildah, runc and debootstrap installed with apt-get
where missing, a Debian 12 base made with debootstrap from Debian's registry and imported (no image registry), the
image built with podman (its layer cache: only what changed is redone), then run with podman: `make demo`'s
classification and the TorchServe seed's commands (ping, register a .mar, `curl .../predictions/NAME -T kitten.jpg`)
in the container, the same on this machine outside it, and the answers compared.

    .venv/bin/python -m tools.cpu_image                 # all of it; exit 0 when every answer is the same
    .venv/bin/python -m tools.cpu_image --build-only    # the image only (prints its name)

Podman's flags here: runc, not crun (crun 1.8 refuses a hybrid cgroup layout whose cgroup2 hierarchy has a
controller); cgroupfs (no systemd); explicit ulimits within this process's hard limits (without CAP_SYS_RESOURCE
podman's default nofile of 1048576 cannot be set)."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tools import cpu_image_serve as serve  # noqa: E402

DOCKERFILE = ROOT / "docker" / "Dockerfile.cpu"
LOCK = ROOT / "docker" / "requirements-cpu.txt"
BASE = "localhost/triton-classifier-debian:bookworm"
IMAGE = "localhost/triton-classifier-cpu"
MIRROR = "http://deb.debian.org/debian"
PACKAGES = {"podman": "podman", "buildah": "buildah", "crun": "crun", "runc": "runc", "debootstrap": "debootstrap"}


class Unavailable(Exception):
    """Containers cannot run on this machine; the message names what failed and the kernel feature missing."""


def say(*words) -> None:
    print("cpu_image:", *words, flush=True)


def image_tag() -> str:
    """The Dockerfile's and the lockfile's sha256: an image of this tag has every heavy layer of this checkout's."""
    digest = hashlib.sha256(DOCKERFILE.read_bytes() + b"\0" + LOCK.read_bytes()).hexdigest()
    return f"{IMAGE}:{digest[:12]}"


def missing_tools() -> list[str]:
    return [name for name in PACKAGES if shutil.which(name) is None]


def ensure_tools() -> None:
    missing = missing_tools()
    if not missing:
        return
    if os.geteuid() != 0:
        raise Unavailable(f"{', '.join(missing)} not installed and not root: apt-get install {' '.join(missing)}")
    say("installing", *missing, "with apt-get")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", *(PACKAGES[name] for name in missing)], check=True, env=env)


def _limit(kind: int, most: int) -> int:
    hard = resource.getrlimit(kind)[1]
    return most if hard == resource.RLIM_INFINITY else min(hard, most)


def podman(*args: str) -> list[str]:
    """podman with this machine's working flags (module docstring); vfs storage where the kernel has no overlayfs."""
    storage = [] if "overlay" in Path("/proc/filesystems").read_text() else ["--storage-driver", "vfs"]
    return ["podman", "--runtime", "runc", "--cgroup-manager", "cgroupfs", *storage, *args]


def limits() -> list[str]:
    # 16384 each, or this process's hard limit where lower: as root without CAP_SYS_RESOURCE, runc cannot raise one.
    nofile, nproc = _limit(resource.RLIMIT_NOFILE, 16384), _limit(resource.RLIMIT_NPROC, 16384)
    return ["--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", f"nproc={nproc}:{nproc}"]


def image_exists(name: str) -> bool:
    return shutil.which("podman") is not None and subprocess.run(podman("image", "exists", name)).returncode == 0


def ensure_base() -> float:
    """The Debian 12 base, debootstrapped from Debian's registry and imported; seconds it took (0: it existed)."""
    if image_exists(BASE):
        return 0.0
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="cpu-image-rootfs-", dir="/var/tmp") as rootfs:
        say("debootstrap --variant=minbase bookworm", MIRROR)
        subprocess.run(["debootstrap", "--variant=minbase", "bookworm", rootfs, MIRROR], check=True,
                       stdout=subprocess.DEVNULL)
        tar = subprocess.Popen(["tar", "-C", rootfs, "-c", "."], stdout=subprocess.PIPE)
        subprocess.run(podman("import", "-", BASE), stdin=tar.stdout, check=True, stdout=subprocess.DEVNULL)
        if tar.wait():
            raise RuntimeError("tar of the debootstrapped base failed")
    return time.monotonic() - start


def _works(*argv: str) -> bool:
    return subprocess.run(argv, capture_output=True).returncode == 0


def kernel_reason() -> str | None:
    """The kernel feature a container needs that this machine lacks, or None where each one works."""
    for flag, feature in (("--mount", "mount namespaces"), ("--uts", "UTS namespaces"), ("--ipc", "IPC namespaces"),
                          ("--net", "network namespaces"), ("--pid", "PID namespaces")):
        if not _works("unshare", flag, "--fork", "true"):
            return f"no {feature} (unshare {flag} fails)"
    if os.geteuid() != 0 and Path("/proc/sys/user/max_user_namespaces").read_text().strip() == "0":
        return "no user namespaces (user.max_user_namespaces = 0), which rootless podman needs"
    if not Path("/sys/fs/cgroup").is_dir() or not os.listdir("/sys/fs/cgroup"):
        return "no cgroup filesystem mounted at /sys/fs/cgroup"
    return None


def probe() -> None:
    """Runs `true` in a container of the base; raises Unavailable naming the failure and the missing kernel feature,
    RuntimeError where it fails with every feature present (a failure, not a missing feature)."""
    done = subprocess.run(podman("run", "--rm", *limits(), BASE, "true"), capture_output=True, text=True, timeout=120)
    if done.returncode == 0:
        return
    error = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
    reason = kernel_reason()
    if reason is None:
        raise RuntimeError(f"podman could not run a container ({error}) though every kernel feature checked is here")
    raise Unavailable(f"podman cannot run a container here: {error}; missing kernel feature: {reason}")


def pip_source() -> tuple[list[str], list[str]]:
    """The build's --build-arg and --volume flags for the registry and CA bundle this machine's pip uses."""
    def setting(variable: str, key: str) -> str:
        if os.environ.get(variable):
            return os.environ[variable]
        got = subprocess.run([sys.executable, "-m", "pip", "config", "get", key], capture_output=True, text=True)
        return got.stdout.strip() if got.returncode == 0 else ""
    args, volumes = [], []
    index = setting("PIP_INDEX_URL", "global.index-url")
    if index.startswith(("http://", "https://")):  # a file:// index is this machine's disk, not the container's
        args += ["--build-arg", f"PIP_INDEX_URL={index}"]
    cert = setting("PIP_CERT", "global.cert")
    if cert and Path(cert).is_file():
        volumes += ["--volume", f"{Path(cert).resolve()}:/run/pip-cert.pem:ro"]
        args += ["--build-arg", "PIP_CERT=/run/pip-cert.pem"]
    return args, volumes


def build() -> tuple[str, float]:
    """The image, built (cached layers reused); its name and the seconds the build took."""
    name = image_tag()
    args, volumes = pip_source()
    start = time.monotonic()
    # --format docker: the OCI format has no HEALTHCHECK (podman drops it, saying so)
    subprocess.run(podman("build", "--format", "docker", "--network", "host", *limits(), *volumes, *args,
                          "-f", str(DOCKERFILE),
                          "-t", name, "-t", f"{IMAGE}:latest", str(ROOT)), check=True)
    return name, time.monotonic() - start


def image_size(name: str) -> int:
    out = subprocess.run(podman("image", "inspect", "--format", "{{.Size}}", name), capture_output=True, text=True,
                         check=True).stdout
    return int(out.strip())


def top5(text: str) -> dict[str, list[tuple[str, float]]]:
    """clients.classify's printed answers: model -> [(label, probability)], in the order printed."""
    found: dict[str, list[tuple[str, float]]] = {}
    model = None
    for line in text.splitlines():
        if re.fullmatch(r"[\w.-]+( \(.*\))?:", line.strip()) and not line.startswith(" "):
            model = line.split(":")[0].split(" ")[0]
            found.setdefault(model, [])
        elif model and (match := re.fullmatch(r'\s+"(.+)": ([\d.e-]+)', line)):
            found[model].append((match.group(1), float(match.group(2))))
    return {key: value for key, value in found.items() if value}


def demo(name: str, model: str) -> dict:
    """`make demo`'s classification (python -m clients.demo) in the container and outside it."""
    argv = ["-m", "clients.demo", "--model", model]
    start = time.monotonic()
    # --no-healthcheck: the image's is Triton's on :8000, which the demo does not serve (and podman schedules one
    # through systemd, which this machine has not)
    inside = subprocess.run(podman("run", "--rm", "--no-healthcheck", "--network", "host", *limits(), name, "python3",
                                   *argv),
                            capture_output=True, text=True, timeout=1800)
    inside_s = time.monotonic() - start
    print(inside.stdout, inside.stderr[-3000:], sep="\n", flush=True)
    with tempfile.TemporaryDirectory(prefix="cpu-image-demo-") as repo:
        start = time.monotonic()
        outside = subprocess.run([sys.executable, *argv, "--repository", repo], capture_output=True, text=True,
                                 timeout=1800, cwd=ROOT)
        outside_s = time.monotonic() - start
    if inside.returncode or outside.returncode:
        raise RuntimeError(f"demo failed: inside rc {inside.returncode}, outside rc {outside.returncode}:\n"
                           f"{inside.stderr[-2000:]}\n{outside.stderr[-2000:]}")
    return {"inside": top5(inside.stdout), "outside": top5(outside.stdout), "inside_s": round(inside_s, 1),
            "outside_s": round(outside_s, 1)}


def same_top5(a: list, b: list, tolerance: float = 1e-6) -> bool:
    return [label for label, _ in a] == [label for label, _ in b] and all(
        abs(p - q) <= tolerance for (_, p), (_, q) in zip(a, b))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.cpu_image", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build-only", action="store_true", help="build the image, run nothing. Default: off.")
    p.add_argument("--model", default="resnet152", help="the demo's model (clients.demo --model). Default: resnet152.")
    p.add_argument("--archive", choices=sorted(serve.ARCHIVES), default="resnet152",
                   help="the TorchServe example's archive: the seed's ResNet-152 or the same with ResNet-18's layers. "
                        "Default: resnet152.")
    p.add_argument("--no-torchserve", action="store_true", help="skip the TorchServe commands. Default: off.")
    p.add_argument("--json", type=Path, help="write what was measured and answered here.")
    args = p.parse_args(argv)
    summary: dict = {}
    try:
        ensure_tools()
        summary["base_s"] = round(ensure_base(), 1)
        probe()
    except Unavailable as exc:
        say(exc)
        if args.json:
            args.json.write_text(json.dumps({"unavailable": str(exc)}, indent=1))
        return 2
    name, seconds = build()
    summary.update(image=name, build_s=round(seconds, 1), size_bytes=image_size(name))
    say(f"{name}: built in {seconds:.0f} s, {summary['size_bytes'] / 2**30:.2f} GiB")
    ok = True
    if not args.build_only:
        summary["demo"] = demo(name, args.model)
        same = {model: same_top5(summary["demo"]["inside"].get(model, []), answers)
                for model, answers in summary["demo"]["outside"].items()}
        summary["demo"]["same"] = same
        ok = bool(same) and all(same.values()) and set(summary["demo"]["inside"]) == set(same)
        say("demo top-5 inside == outside:", same)
        if not args.no_torchserve:
            summary["torchserve"] = serve.compare(name, podman, limits(), args.archive)
            ok = ok and summary["torchserve"]["same"]
            say("TorchServe commands inside == outside:", summary["torchserve"]["same"])
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    if not args.build_only:
        say("ALL SAME" if ok else "DIFFERENT (see above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
