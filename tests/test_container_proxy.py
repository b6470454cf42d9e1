"""The proxy in docker/compose.yaml and docker/k8s/: the same proxy/haproxy.cfg + guard.lua serve-repo runs, with
the environment it reads, serve-repo's limits, Triton's ports private, and clients, probes and Prometheus going
through the proxy. Checked here, with the real HAProxy's own configuration check: no docker engine or cluster.
"""
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from server.proxy import PROXY_DIR, Proxy, ProxySettings, haproxy_binary
from support import ROOT
from test_container_files import DOCKER, _compose, _container, _kind
from tools import proxy_configmap

CONFIG = PROXY_DIR / "haproxy.cfg"
# The variables the configuration reads only inside `.if defined(...)` blocks: optional.
OPTIONAL = set(re.findall(r"^\.if defined\((\w+)\)", CONFIG.read_text(), re.M))
DEFAULTS = ProxySettings("127.0.0.1", 0, 0)


def _compose_env() -> dict[str, str]:
    return {name: str(value) for name, value in _compose("proxy")["environment"].items()}


def _k8s_env() -> dict[str, str]:
    return {item["name"]: item["value"] for item in _container("proxy")["env"]}


def _port(address: str) -> int:
    return int(address.rpartition(":")[2])


def _haproxy_check(env: dict[str, str]) -> subprocess.CompletedProcess:
    """HAProxy's own check of proxy/haproxy.cfg with a deployment's environment (its files from here)."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("PROXY_", "TRITON_"))},
           **env, "PROXY_DIR": str(PROXY_DIR)}
    return subprocess.run([haproxy_binary(), "-c", "-f", str(CONFIG)], env=env, capture_output=True, text=True, timeout=60)


def test_proxy_config_reads_the_same_variables_everywhere_when_compared():
    required = set(re.findall(r"\$\{(\w+)\}", CONFIG.read_text())) - OPTIONAL
    serve_repo = Proxy(DEFAULTS, "127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3", Path("/nonexistent")).environment()
    assert required and required <= set(serve_repo) and required <= set(_compose_env()) <= required | OPTIONAL
    assert required <= set(_k8s_env()) <= required | OPTIONAL


@pytest.mark.parametrize("where", ["compose", "k8s"])
def test_deployments_keep_serve_repos_proxy_limits_when_read(where):
    env = _compose_env() if where == "compose" else _k8s_env()
    assert (int(env["PROXY_MAX_BODY"]), int(env["PROXY_RATE_10S"]), int(env["PROXY_RETRIES"])) == (
        DEFAULTS.max_body_bytes, DEFAULTS.rate_per_10s, DEFAULTS.retries)
    serve_repo = Proxy(DEFAULTS, "127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3", Path("/nonexistent")).environment()
    for name in ("PROXY_QUEUE_MS", "PROXY_QUEUE_TIMEOUT", "PROXY_MAXCONN", "PROXY_CONN_PER_CLIENT"):
        assert env[name] == serve_repo[name], name


@pytest.mark.parametrize("where", ["compose", "k8s"])
def test_haproxy_accepts_the_config_with_the_deployments_environment_when_checked(where):
    result = _haproxy_check(_compose_env() if where == "compose" else _k8s_env())
    assert result.returncode == 0, result.stdout + result.stderr


def test_haproxy_refuses_the_config_when_a_variable_is_missing():
    env = _k8s_env()
    del env["TRITON_GRPC"]
    result = _haproxy_check(env)
    assert result.returncode != 0 and "'server' expects <name> and <addr>" in result.stdout + result.stderr


def test_compose_mounts_proxy_folder_unchanged_where_the_config_looks_when_parsed():
    proxy = _compose("proxy")
    assert proxy["volumes"] == [f"../proxy:{_compose_env()['PROXY_DIR']}:ro"]  # relative to docker/
    assert proxy["command"] == ["haproxy", "-f", f"{_compose_env()['PROXY_DIR']}/haproxy.cfg"]


def test_k8s_config_map_holds_the_proxy_files_unchanged_when_generated():
    assert proxy_configmap.main(["--check"]) == 0
    data = _kind("ConfigMap")["data"]
    assert data == {path.name: path.read_text() for path in proxy_configmap.SOURCES}
    proxy = _container("proxy")
    (mount,) = proxy["volumeMounts"]
    (volume,) = [v for v in _kind("Deployment")["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    assert volume["configMap"]["name"] == _kind("ConfigMap")["metadata"]["name"]
    assert mount["mountPath"] == _k8s_env()["PROXY_DIR"] and proxy["args"][-1] == f"{mount['mountPath']}/haproxy.cfg"


def test_config_map_check_fails_when_the_proxy_files_change(tmp_path, monkeypatch):
    changed = tmp_path / "haproxy.cfg"
    changed.write_text(CONFIG.read_text().replace("nbthread 2", "nbthread 4"))
    monkeypatch.setattr(proxy_configmap, "SOURCES", [changed, PROXY_DIR / "guard.lua"])
    assert proxy_configmap.main(["--check"]) == 1


def test_both_deployments_run_one_haproxy_image_of_the_branch_setup_installs_when_read():
    images = {_compose("proxy")["image"], _container("proxy")["image"]}
    (image,) = images
    assert re.fullmatch(r"haproxy:\d+\.\d+\.\d+", image), "a patch release, not a moving tag"
    installed = subprocess.run([haproxy_binary(), "-v"], capture_output=True, text=True).stdout
    branch = re.search(r"version (\d+\.\d+)\.", installed).group(1)
    assert image.split(":")[1].startswith(branch + ".")


def test_compose_publishes_only_the_proxy_ports_and_keeps_tritons_on_its_network_when_parsed():
    env = _compose_env()
    assert sorted(_compose("proxy")["ports"]) == [f"{_port(env[k])}:{_port(env[k])}"
                                                  for k in ("PROXY_HTTP_BIND", "PROXY_GRPC_BIND")]
    assert "ports" not in _compose()
    exposed, _ = re.findall(r"^EXPOSE (.+)$", (DOCKER / "Dockerfile").read_text(), re.M)  # Triton's, the TorchServe front's
    assert sorted(int(p) for p in _compose()["expose"]) == sorted(int(p) for p in exposed.split()) == sorted(
        _port(env[k]) for k in ("TRITON_HTTP", "TRITON_GRPC", "TRITON_METRICS"))
    assert all(env[k].startswith("triton:") for k in ("TRITON_HTTP", "TRITON_GRPC", "TRITON_METRICS"))
    assert "triton" in _compose("proxy")["depends_on"]


def test_k8s_triton_listens_on_loopback_and_the_proxy_beside_it_reaches_it_when_parsed():
    args, env = _container()["args"], _k8s_env()
    assert {"--http-address=127.0.0.1", "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1"} <= set(args)
    exposed, _ = re.findall(r"^EXPOSE (.+)$", (DOCKER / "Dockerfile").read_text(), re.M)  # Triton's, the TorchServe front's
    assert [env[k] for k in ("TRITON_HTTP", "TRITON_GRPC", "TRITON_METRICS")] == [
        f"127.0.0.1:{p}" for p in exposed.split()]  # Triton's default ports, not moved by any flag
    assert not any(arg.startswith(("--http-port", "--grpc-port", "--metrics-port")) for arg in args)
    assert "ports" not in _container()  # nothing of Triton's is reachable from outside the pod


def test_k8s_service_reaches_only_the_proxy_when_parsed():
    proxy = _container("proxy")
    named = {p["name"]: p["containerPort"] for p in proxy["ports"]}
    env = _k8s_env()
    assert named == {"http": _port(env["PROXY_HTTP_BIND"]), "grpc": _port(env["PROXY_GRPC_BIND"])}
    service = {(p["name"], p["port"], p["targetPort"]) for p in _kind("Service")["spec"]["ports"]}
    assert service == {("http", 8000, "http"), ("grpc", 8001, "grpc")}  # what clients used before the proxy
    annotations = _kind("Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert (int(annotations["prometheus.io/port"]), annotations["prometheus.io/path"]) == (named["http"], "/metrics")


def test_k8s_probes_check_triton_inside_its_container_and_the_proxy_through_itself_when_parsed():
    dockerfile = (DOCKER / "Dockerfile").read_text().replace("\\\n", " ")
    (healthcheck,) = re.findall(r"^HEALTHCHECK .*?\bCMD (\[.*\])$", dockerfile, re.M)
    ready = json.loads(healthcheck)
    triton = _container()
    assert triton["readinessProbe"]["exec"]["command"] == triton["startupProbe"]["exec"]["command"] == ready
    assert triton["livenessProbe"]["exec"]["command"] == [*ready[:-1], ready[-1].replace("/ready", "/live")]
    proxy = _container("proxy")
    assert proxy["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    assert proxy["livenessProbe"]["tcpSocket"] == {"port": "http"}


def test_k8s_proxy_outlives_tritons_drain_within_the_grace_period_when_parsed():
    pod = _kind("Deployment")["spec"]["template"]["spec"]
    (sleep, seconds) = _container("proxy")["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep == "sleep"
    drain = next((int(arg.partition("=")[2]) for arg in _container()["args"] if arg.startswith("--exit-timeout-secs")),
                 30)  # Triton's default
    assert drain <= int(seconds) < pod["terminationGracePeriodSeconds"]


def test_docs_name_the_generated_config_map_when_read():
    text = (DOCKER / "k8s" / "README.md").read_text()
    assert "proxy-config.yaml" in text and "python -m tools.proxy_configmap" in text
    assert yaml.safe_load((DOCKER / "k8s" / "proxy-config.yaml").read_text())["kind"] == "ConfigMap"
    assert (ROOT / "tools" / "proxy_configmap.py").is_file()


# What probes and Prometheus ask through the proxy. They carry no token (a kubelet's httpGet probe takes
# literal headers only, not a Secret; annotation-discovered scrapes none), so the guard lets token-less GETs
# of exactly these paths through when PROXY_TOKEN_FILE is set; everything else still needs the token.
TOKENLESS = {"/v2/health/ready", "/v2/health/live", "/metrics"}


def test_probes_and_scrapes_through_the_proxy_ask_only_token_free_paths_without_headers_when_parsed():
    proxy, pod = _container("proxy"), _kind("Deployment")["spec"]["template"]
    through_proxy = [proxy[kind]["httpGet"] for kind in ("readinessProbe", "livenessProbe", "startupProbe")
                     if "httpGet" in proxy.get(kind, {})]
    assert through_proxy and all(get["path"] in TOKENLESS and "httpHeaders" not in get for get in through_proxy)
    assert pod["metadata"]["annotations"]["prometheus.io/path"] in TOKENLESS
    # Triton's own probes reach Triton itself (its port in the pod), never the proxy: no token there either.
    triton_port = _port(_k8s_env()["TRITON_HTTP"])
    for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
        (url,) = [arg for arg in _container()[kind]["exec"]["command"] if "/v2/health/" in arg]
        assert url.startswith(f"localhost:{triton_port}/") and url.partition("/")[2] in {p[1:] for p in TOKENLESS}
    assert "healthcheck" not in _compose("proxy")  # compose checks Triton itself (Dockerfile's HEALTHCHECK)


@pytest.fixture
def fake_triton():
    """An HTTP server answering 200 to every GET, where the proxy expects Triton's HTTP and metrics ports."""
    import http.server
    import threading

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(200)
            self.send_header("content-length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_probes_and_scrapes_get_through_without_the_token_and_nothing_else_does_when_a_token_is_set(
        tmp_path, fake_triton):
    import urllib.error
    import urllib.request

    from common.procs import free_port

    token = tmp_path / "token"
    token.write_text("a-token-of-more-than-16-characters\n")
    settings = ProxySettings("127.0.0.1", free_port(), free_port(), token_file=token)
    proxy = Proxy(settings, fake_triton, "127.0.0.1:1", fake_triton, tmp_path).start()

    def status(path: str, method: str = "GET") -> int:
        request = urllib.request.Request(f"http://{proxy.http_url}{path}", method=method)
        try:
            with urllib.request.urlopen(request, timeout=30) as reply:
                return reply.status
        except urllib.error.HTTPError as error:
            return error.code
    try:
        assert {path: status(path) for path in sorted(TOKENLESS)} == {path: 200 for path in sorted(TOKENLESS)}
        assert status("/v2/models/m") == status("/v2/models/m/config") == status("/v2") == 401
    finally:
        proxy.stop()
