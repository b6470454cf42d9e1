"""`python -m server.torchserve.ping CONFIG`: the container's health check of the TorchServe front, GET /ping on
config.properties' inference address with key_file.json's inference key (tokens on): exit 0 on 200, else 1.

A Docker health check and a Kubernetes probe cannot read the key themselves (an httpGet probe takes literal headers),
and with tokens on /ping answers 400 without it, as TorchServe's does."""
from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from pathlib import Path

from common.cli import OneLineParser
from server.torchserve.properties import PropertiesError, settings

KEY_FILE = "key_file.json"  # serve-repo writes it in its working directory, as TorchServe does (run.py)
# An address that listens everywhere is asked on loopback.
LOOPBACK = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


def url(config: Path | None) -> str:
    """/ping on the inference address `config` names (TorchServe's default without one)."""
    host, port = settings(config).inference
    host = LOOPBACK.get(host, host)
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/ping"


def headers(key_file: Path) -> dict[str, str]:
    """The inference key's header where serve-repo wrote a key file (tokens on); none where it did not."""
    try:
        keys = json.loads(key_file.read_text())
    except FileNotFoundError:
        return {}
    return {"Authorization": f"Bearer {keys['inference']['key']}"}


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m server.torchserve.ping", description=__doc__)
    p.add_argument("config", metavar="CONFIG", type=Path, nargs="?",
                   help="serve-repo's --torchserve-config. Default: none (TorchServe's 127.0.0.1:8080).")
    p.add_argument("--key-file", metavar="FILE", type=Path, default=Path(KEY_FILE),
                   help=f"serve-repo's key file. Default: {KEY_FILE} (in the working directory, where it writes it).")
    p.add_argument("--timeout", metavar="S", type=float, default=3, help="Default: 3.")
    args = p.parse_args(argv)
    try:
        request = urllib.request.Request(url(args.config), headers=headers(args.key_file))
        with urllib.request.urlopen(request, timeout=args.timeout) as reply:
            status = reply.status
    except urllib.error.HTTPError as error:
        status = error.code
    except (OSError, ValueError, KeyError, PropertiesError) as exc:
        print(f"ping: {exc}", file=sys.stderr)
        return 1
    if status != 200:
        print(f"ping: HTTP {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
