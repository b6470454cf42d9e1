"""The main job in one command: build the ResNet-152 repository, serve it, classify a cat, stop."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from builder import cli as build_repo
from server.triton import ServerError, TritonServer
from common.procs import free_port
from clients import classify

SAMPLE = Path(__file__).resolve().parent / "samples" / "chelsea.jpg"  # scikit-image's cat, CC0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m clients.demo", description=__doc__)
    p.add_argument("--model", default="resnet152", help="torchvision model. Default: resnet152.")
    p.add_argument("--repository", type=Path, default=Path("model_repository"),
                   help="where to build it. Default: model_repository.")
    p.add_argument("--rebuild", action="store_true", help="rebuild even if the model exists. Default: off.")
    p.add_argument("images", nargs="*", type=Path, default=[SAMPLE], help=f"Default: {SAMPLE.name}.")
    args = p.parse_args(argv)
    if args.rebuild or not (args.repository / args.model / "config.pbtxt").is_file():
        build = ["--model", args.model, "--output", str(args.repository), "--force"]
        if build_repo.main([*build, "--weights", "auto"]):
            # Asked for here, never chosen by build-repo: the demo shows the path, not the labels.
            print(f"demo: no pretrained {args.model} weights here (no network, no cache): serving seeded random "
                  "weights instead (--weights random): the labels below are MEANINGLESS", file=sys.stderr)
            status = build_repo.main([*build, "--weights", "random"])
            if status:
                return status
    else:
        print(f"using the existing {args.repository / args.model} (--rebuild to rebuild)")
    ports = [free_port() for _ in range(3)]
    try:
        with TritonServer(args.repository, *ports) as server:
            print(f"tritonserver ready on {server.http_url}; classifying {', '.join(map(str, args.images))}",
                  flush=True)
            return classify.main([*map(str, args.images), "--url", server.http_url, "--model", args.model])
    except ServerError as exc:
        print(f"demo: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
