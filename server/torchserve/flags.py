"""Which of serve-repo's flags apply in which mode: a flag given where it cannot act is refused in one line that
names it and what to use instead, never accepted and left unread."""
from __future__ import annotations

import argparse

_ADDRESSES = "config.properties' inference_address/management_address/metrics_address"
_PROXY = ("HAProxy's, which fronts Triton's own API (--repository); TorchServe mode runs none: Triton listens on no "
          "TCP port and the TorchServe front bounds its own requests")

# Triton-mode flags with no meaning in TorchServe mode, each with what does that job there. The others apply in
# both modes and are read by server/torchserve/run.py: --log-file, --stub-python, --timeout, --canary,
# --drain-seconds, --max-restarts, --max-unfreed-instances, --unfreed-grace-s and the tritonserver flags after `--`.
TRITON_ONLY = {
    "repository": "in TorchServe mode the archives come from the model store: --model-store DIR or model_store= "
                  "in config.properties",
    "http_port": f"in TorchServe mode the ports are {_ADDRESSES}",
    "grpc_port": "in TorchServe mode the gRPC ports are TorchServe's: config.properties' grpc_inference_port "
                 "(7070) and grpc_management_port (7071); Triton's own gRPC is off",
    "metrics_port": "in TorchServe mode the metrics port is config.properties' metrics_address",
    "host": f"in TorchServe mode the addresses are {_ADDRESSES} (e.g. inference_address=http://0.0.0.0:8080)",
    "proxy": f"{_PROXY}; TLS and per-client rates belong to an ingress in front (--proxy off is accepted)",
    "tls_cert": f"{_PROXY}; terminate TLS in an ingress in front of {_ADDRESSES}",
    "tls_key": f"{_PROXY}; terminate TLS in an ingress in front of {_ADDRESSES}",
    "token_file": "in TorchServe mode the tokens are TorchServe's: key_file.json in the working directory, "
                  "written at start (--disable-token-auth or disable_token_authorization=true: none)",
    "max_body_mb": "in TorchServe mode the largest body is config.properties' max_request_size (bytes)",
    "rate_limit": f"{_PROXY}; per-client rates belong to an ingress in front",
    "trusted_proxies": f"{_PROXY}; it counts no clients, so it has no proxies to trust",
    "max_in_flight": f"{_PROXY}; a model takes a batch per worker (initial_workers, minWorkers) and "
                     "config.properties' job_queue_size more, then 503",
    "queue_ms": f"{_PROXY}; config.properties' job_queue_size bounds the waiting requests (503 beyond)",
    "model_control": "in TorchServe mode models are registered and unregistered through the management API: "
                     "enable_model_api=true in config.properties or --enable-model-api",
}
# TorchServe-mode flags (build-repo's options for the store's archives, torchserve's own flags).
TORCHSERVE_ONLY = ("models", "enable_model_api", "disable_token_auth", "ncs", "keep_snapshots", "snapshot_fallback",
                   "precision", "engine", "handler_path", "trust_model_code")


def given(parser: argparse.ArgumentParser, argv: list[str] | None) -> list[str]:
    """The dests of the options `argv` names, in the parser's order (a default left alone is not given, even
    where the flag would repeat it: `--http-port 8000` is a port asked for)."""
    unset = object()  # argparse sets no default where the namespace holds the dest already
    dests = list(vars(parser.parse_args([])))  # every dest, in the parser's order
    named = vars(parser.parse_args(argv, argparse.Namespace(**dict.fromkeys(dests, unset))))
    return [dest for dest in dests if named[dest] is not unset]


def flag(dest: str) -> str:
    """The option that sets `dest` (every flag of the two tables above is spelled so: tests/test_torchserve_flags.py)."""
    return "--" + dest.replace("_", "-")


def refusal(parser: argparse.ArgumentParser, dests: list[str], args, torchserve: bool) -> str | None:
    """One line for the first flag given that this mode cannot act on, or None."""
    for dest in dests:
        if torchserve and dest in TRITON_ONLY and not (dest == "proxy" and args.proxy == "off"):
            return f"{flag(dest)}: {TRITON_ONLY[dest]}"
        if not torchserve and dest in TORCHSERVE_ONLY:
            return (f"{flag(dest)}: a TorchServe-mode flag (with --model-store DIR or --torchserve-config FILE); "
                    "with --repository, build-repo's options make the repository")
    return None
