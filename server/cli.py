"""`serve-repo`: serve a model repository with the real tritonserver bundled in the nvidia-pytriton wheel,
supervised: restarted when it dies, a model reloaded when its stub dies, drained on SIGTERM."""
from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import threading
from pathlib import Path

from common.cli import OneLineParser
from common.procs import port_free
from server import canary
from server.procfs import KEPT_LOG_FOLDER
from server.proxy import Proxy, ProxySettings, busy, exposed
from server.supervisor import Supervisor
from server.repo import GPU_FLAGS, in_flight
from server.torchserve import flags
from server.triton import ServerError, TritonServer


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="serve-repo", description=__doc__)
    p.add_argument("--repository", metavar="DIR", type=Path, default=Path("model_repository"),
                   help="model repository to serve. Default: model_repository.")
    p.add_argument("--http-port", metavar="N", type=int, default=8000, help="Default: 8000.")
    p.add_argument("--grpc-port", metavar="N", type=int, default=8001, help="Default: 8001.")
    p.add_argument("--metrics-port", metavar="N", type=int, default=8002, help="Default: 8002.")
    p.add_argument("--host", metavar="ADDRESS", default="127.0.0.1",
                   help="address the HTTP and gRPC ports listen on. Beyond loopback (e.g. 0.0.0.0) the proxy "
                        "listens there and Triton's own ports stay on 127.0.0.1. Default: 127.0.0.1.")
    p.add_argument("--proxy", choices=("auto", "on", "off"), default="auto",
                   help="HAProxy (proxy/haproxy.cfg) in front of Triton: refuses the JSON requests that abort "
                        "Triton 2.51, caps bodies and per-client rates, holds requests while Triton restarts, "
                        "keeps the repository API private; TLS and a token when asked. auto: on when --host is "
                        "not loopback or is IPv6 (tritonserver 2.51 cannot listen on an IPv6 address); off: "
                        "Triton's ports face --host directly. Default: auto.")
    p.add_argument("--tls-cert", metavar="PEM", type=Path,
                   help="certificate for the proxy's ports (both then speak TLS only); needs the proxy. "
                        "Default: none (plain HTTP and gRPC).")
    p.add_argument("--tls-key", metavar="PEM", type=Path,
                   help="the certificate's private key, where it is not in --tls-cert's file. Default: none.")
    p.add_argument("--token-file", metavar="FILE", type=Path,
                   help="a file whose first line (16+ characters) every request must bear as 'authorization: "
                        "Bearer TOKEN' (HTTP header or gRPC metadata), else 401; needs the proxy. Default: none.")
    p.add_argument("--max-body-mb", metavar="MB", type=float, default=8,
                   help="largest HTTP request body the proxy lets through (413 beyond). Default: 8.")
    p.add_argument("--rate-limit", metavar="N", type=int, default=50_000,
                   help="requests one client address may send through the proxy in 10 s (429 beyond). "
                        "Default: 50000.")
    p.add_argument("--trusted-proxies", metavar="CIDR", nargs="+",
                   help="address ranges of a proxy in front of this one (an ingress): the proxy counts their "
                        "requests per client by the last X-Forwarded-For address and does not cap their "
                        "connections per client. Default: none (every client counted by its own address; an IPv6 "
                        "client by its /64).")
    p.add_argument("--max-in-flight", metavar="N", type=int,
                   help="inference requests the proxy lets reach Triton at once, per port; the rest wait in the "
                        "proxy's queue. Default: twice the largest model's max_batch_size x instances (8 at "
                        "least; 16 for build-repo's CPU defaults).")
    p.add_argument("--queue-ms", metavar="MS", type=int, default=500,
                   help="overload: a request that would expect to wait longer than this in the proxy's queue (at "
                        "the rate Triton answers now) is refused at once with 503 (gRPC UNAVAILABLE), rule "
                        "overload; none waits there over twice this. Default: 500.")
    p.add_argument("--model-control", choices=("none", "explicit"), default="none",
                   help="explicit: models may be (re)loaded live through the repository API (perf.tune "
                        "uses it). none: the repository API needs a key only serve-repo holds. The server "
                        "always runs in Triton's explicit mode so that it can skip models it has no backend "
                        "for and reload a model whose stub died. Default: none.")
    p.add_argument("--drain-seconds", metavar="S", type=float, default=5,
                   help="on SIGTERM/SIGINT, how long in-flight requests may take to finish before the "
                        "server and its stubs are killed (Triton's --exit-timeout-secs). Default: 5.")
    p.add_argument("--max-restarts", metavar="N", type=int, default=5,
                   help="restarts in a row (each lived < 60 s) before giving up when tritonserver (or the proxy) "
                        "keeps dying; 0: never restart. Default: 5.")
    p.add_argument("--max-unfreed-instances", metavar="N", type=int, default=4,
                   help="a stub that dies with a batch in flight leaves an instance Triton 2.51 never frees "
                        "(its threads and ~5-10 MB of /dev/shm); past this many, tritonserver is restarted "
                        "(drained) to free them; 0: never. Default: 4.")
    p.add_argument("--unfreed-grace-s", metavar="S", type=float, default=30,
                   help="how long a dead stub may stay unreaped (Triton may still free its instance) before it "
                        "counts towards --max-unfreed-instances. Default: 30.")
    p.add_argument("--log-file", metavar="FILE", type=Path,
                   help="tritonserver's log; the proxy's goes to FILE.haproxy.log. Default: a temporary file "
                        "(removed after a clean stop, kept after a failure); the proxy's is "
                        "<tmp>/triton-serve-logs/haproxy-<http port>.log, kept.")
    p.add_argument("--stub-python", metavar="PYTHON3", type=Path,
                   help="the python3 whose environment the python backend's stubs run in (they take the first python3 "
                        "on PATH; its numpy must be 1.x: checked before tritonserver starts). Default: "
                        "$SERVE_REPO_STUB_PYTHON, else this interpreter's folder's python3.")
    p.add_argument("--timeout", metavar="S", type=float, default=600, help="seconds to wait until ready. Default: 600.")
    p.add_argument("--canary", choices=("on", "off"), default="on",
                   help="on: before saying ready, and after a model is replaced or registered, send each model one "
                        "request (zeros of its declared input, a tiny JPEG to NAME_image) and refuse one whose answer "
                        "is empty, not finite or not of its declared shape and dtype (server/canary.py). off: for "
                        "a model whose answer to zeros is legitimately not finite. Default: on.")
    ts = p.add_argument_group(
        "TorchServe's API (instead of --repository: start as torchserve starts)",
        "Of the options above, --log-file, --stub-python, --timeout, --canary, --drain-seconds, --max-restarts,\n"
        "--max-unfreed-instances, --unfreed-grace-s and tritonserver's flags after -- apply here too; the others\n"
        "(Triton's own API, the proxy's) are refused in one line naming what does their job. The options below\n"
        "need --model-store or --torchserve-config.")
    ts.add_argument("--torchserve-config", "--ts-config", metavar="FILE", type=Path,
                    help="TorchServe's config.properties: its inference, management and metrics addresses, gRPC "
                         "ports, "
                         "model_store, load_models, models, enable_model_api, max_request_size, job_queue_size, "
                         "token settings; a key not supported here is named once in the log. Default: none.")
    ts.add_argument("--model-store", metavar="DIR", type=Path,
                    help="TorchServe's model store (.mar files): serve its API on ports 8080/8081/8082 (gRPC 7070/7071), each "
                         "archive built by build-repo --from-mar (cached in DIR/.triton) and batched by Triton. "
                         "Default: model_store= of --torchserve-config.")
    ts.add_argument("--models", metavar="MODEL", nargs="+",
                    help="archives to load at start, as torchserve --models: all, FILE.mar or NAME=FILE.mar. "
                         "Default: load_models= of --torchserve-config, else none.")
    ts.add_argument("--enable-model-api", action="store_true",
                    help="allow registering and unregistering models (POST/DELETE /models), as TorchServe >= "
                         "0.11.1. Default: off.")
    ts.add_argument("--disable-token-auth", action="store_true",
                    help="no token on the TorchServe APIs (else key_file.json in the working directory holds the "
                         "inference and management keys). Default: tokens on, as TorchServe >= 0.11.")
    ts.add_argument("--ncs", "--no-config-snapshots", dest="ncs", action="store_true",
                    help="no config snapshots, as torchserve --ncs: none written to LOG_LOCATION/config (else "
                         "logs/config in the working directory) and, with no --torchserve-config, none read: the "
                         "registrations last one run. Default: snapshots on, the newest one read when no config "
                         "file is given.")
    ts.add_argument("--keep-snapshots", type=int, default=10, metavar="N",
                    help="config snapshots kept: each one written removes those beyond the newest N (0: none "
                         "removed, as TorchServe). Default: 10.")
    ts.add_argument("--snapshot-fallback", choices=("on", "off"), default="on",
                    help="with no --torchserve-config, a newest snapshot that cannot be read: on, the newest one "
                         "that can be is read instead (said in one line); off, the start is refused (exit 2). "
                         "Default: on.")
    ts.add_argument("--precision", choices=("auto", "fp32", "fp16", "bf16", "int8"),
                    help="build-repo --precision for the archives. Default: build-repo's (fp32 on CPU: the "
                         "archive's own answers).")
    ts.add_argument("--engine", choices=("auto", "torch", "torchscript", "onnxruntime", "openvino"),
                    help="build-repo --engine for the archives (on the handler path: openvino runs the handler's "
                         "model on OpenVINO once it matched eager PyTorch on the first batch; torch runs it as "
                         "TorchServe does). Default: build-repo's (openvino on CPU).")
    ts.add_argument("--handler-path", action="store_true",
                    help="build-repo --handler-path: serve every archive with its own handler (TorchServe's "
                         "handle() per batch), image_classifier ones too, for comparison. Default: off "
                         "(image_classifier archives take the image path).")
    ts.add_argument("--trust-model-code", action="store_true",
                    help="accepted and not needed (one log line says so): as under TorchServe, the archives in the "
                         "model store and those allowed_urls admits run their code (build-repo --trust-model-code "
                         "for each). Default: off.")
    p.add_argument("triton_args", nargs=argparse.REMAINDER, metavar="-- TRITONSERVER_FLAG ...",
                   help="flags passed to tritonserver unchanged, after `--` (e.g. -- --log-verbose=1 "
                        "--cuda-memory-pool-byte-size=0:1073741824). Default: none; a repository with GPU "
                        "models gets " + " ".join(GPU_FLAGS) + " unless the same flags are passed.")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if min(args.drain_seconds, args.max_restarts, args.max_unfreed_instances, args.unfreed_grace_s) < 0:
        p.error("--drain-seconds, --max-restarts, --max-unfreed-instances and --unfreed-grace-s must be >= 0")
    if args.max_in_flight is not None and args.max_in_flight < 1 or args.queue_ms < 1:
        p.error("--max-in-flight and --queue-ms must be >= 1")
    extra = args.triton_args[1:] if args.triton_args[:1] == ["--"] else args.triton_args
    torchserve = bool(args.torchserve_config or args.model_store)
    refused = flags.refusal(p, flags.given(parser(), argv), args, torchserve)
    if refused:  # before anything starts: a flag this mode would leave unread
        p.error(refused)
    if torchserve:
        return _torchserve(args, extra)
    ipv6 = ":" in args.host  # Triton 2.51's gRPC server cannot parse an IPv6 address: the proxy listens there
    use_proxy = args.proxy == "on" or args.proxy == "auto" and (exposed(args.host) or ipv6)
    if not use_proxy and ipv6:
        p.error(f"tritonserver 2.51 cannot listen on {args.host} (IPv6): drop --proxy off")
    if not use_proxy and (args.tls_cert or args.tls_key or args.token_file):
        p.error("--tls-cert, --tls-key and --token-file are the proxy's: drop --proxy off")
    if args.tls_key and not args.tls_cert:
        p.error("--tls-key goes with --tls-cert")
    if use_proxy:  # Triton on private loopback ports; the proxy takes the ones asked for
        for api, port in (("http", args.http_port), ("grpc", args.grpc_port)):
            if not port_free(args.host, port):  # before Triton starts: another serve-repo may hold them
                print(f"serve-repo: error: {busy(api, port, args.host)}", file=sys.stderr)
                return 1
        server = TritonServer.local(args.repository, model_control=args.model_control, log_file=args.log_file,
                                    extra_args=extra, drain_seconds=args.drain_seconds, stub_python=args.stub_python)
        settings = ProxySettings(args.host, args.http_port, args.grpc_port, int(args.max_body_mb * (1 << 20)),
                                 args.rate_limit, max_in_flight=args.max_in_flight or in_flight(args.repository),
                                 queue_ms=args.queue_ms, trusted=" ".join(args.trusted_proxies or []) or None,
                                 tls_cert=args.tls_cert, tls_key=args.tls_key,
                                 token_file=args.token_file)
    else:
        server = TritonServer(args.repository, args.http_port, args.grpc_port, args.metrics_port, args.host,
                              args.model_control, args.log_file, extra, drain_seconds=args.drain_seconds,
                              stub_python=args.stub_python)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        server.start(args.timeout, abort=stop)
    except ServerError as exc:
        _print_kept_logs(server)
        server.stop(keep_log=not stop.is_set())
        print(f"serve-repo: error: {exc}{_log_of(server)}", file=sys.stderr)
        return 1 if not stop.is_set() else 130
    _print_kept_logs(server)
    for name, why in server.skipped.items():
        print(f"skipped {name}: {why}", flush=True)
    try:  # Triton's READY means its stubs started, not that they answer (NumPy 2 under the r24.10 stub: empty)
        if args.canary == "on":
            print(canary.run(server).line(), flush=True)
    except ServerError as exc:
        server.stop(keep_log=True)
        print(f"serve-repo: error: {exc}{_log_of(server)}", file=sys.stderr)
        return 1
    proxy = None
    if use_proxy:
        proxy = Proxy(settings, server.http_url, server.grpc_url, f"127.0.0.1:{server.ports['metrics']}",
                      server.workdir, proxy_log(args.log_file, args.http_port))
        try:
            proxy.start()
        except (ServerError, OSError) as exc:
            server.stop()
            print(f"serve-repo: error: {exc}; proxy log {proxy.log_file}", file=sys.stderr)
            return 1
        scheme = "https" if args.tls_cert else "http"
        print(f"proxy ready: HTTP {scheme}://{proxy.http_url}  gRPC {proxy.grpc_url}  metrics "
              f"{scheme}://{proxy.http_url}/metrics  (tritonserver on 127.0.0.1:{server.ports['http']}/"
              f"{server.ports['grpc']}, private)  max-in-flight {settings.max_in_flight}  queue-ms {settings.queue_ms}"
              f"  log {proxy.log_file}", flush=True)
    else:
        print(f"tritonserver ready: HTTP {server.http_url}  gRPC {server.grpc_url}  "
              f"metrics http://{args.host}:{args.metrics_port}/metrics  log {server.log_file}", flush=True)
    supervisor = Supervisor(server, max_restarts=args.max_restarts, start_timeout=args.timeout,
                            log=lambda line: print(line, flush=True), max_unfreed=args.max_unfreed_instances,
                            unfreed_grace=args.unfreed_grace_s, proxy=proxy, canary=args.canary == "on")
    status = supervisor.run(stop)
    if status:
        if proxy is not None:
            proxy.stop()
        server.stop(keep_log=True)
        proxy_log_note = f"; proxy log {proxy.log_file}" if proxy is not None else ""
        print(f"serve-repo: error: {supervisor.failure}{_log_of(server)}{proxy_log_note}", file=sys.stderr)
        return 1
    print(f"stopping: draining in-flight requests for up to {args.drain_seconds:g}s", flush=True)
    if proxy is not None:
        proxy.stop()  # first: no new request reaches a draining Triton
    server.stop()
    print("tritonserver stopped", flush=True)
    return 0


def _torchserve(args, extra: list[str]) -> int:
    from server.torchserve.run import serve

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())

    def log(line: str, error: bool = False) -> None:
        print(line, file=sys.stderr if error else sys.stdout, flush=True)
    return serve(args, extra, stop, log)


def proxy_log(log_file: Path | None, http_port: int) -> Path:
    """Where the proxy logs, outside serve-repo's temporary workdir so that it outlives the run: beside
    --log-file, else in the folder that keeps dead runs' tritonserver logs, one file per public port (the
    newest run on that port: no pile of files)."""
    if log_file is not None:
        return Path(f"{log_file}.haproxy.log")
    return Path(tempfile.gettempdir()) / KEPT_LOG_FOLDER / f"haproxy-{http_port}.log"


def _log_of(server: TritonServer) -> str:
    """'; log PATH' where tritonserver's log of this run is kept, or nothing (it never started)."""
    return f"; log {server.log_file}" if server.log_file and server.log_file.is_file() else ""


def _print_kept_logs(server: TritonServer) -> None:
    for entry in server.cleaned:
        if entry.startswith("kept log "):
            print(f"serve-repo: the log of a dead earlier run is {entry[len('kept log '):]}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
