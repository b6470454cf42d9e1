"""No flag ignored (issue 44): each serve-repo flag a mode cannot act on is refused in one line before anything
starts; each flag TorchServe mode honours reaches what it configures (tritonserver, the supervisor, build-repo)."""
from __future__ import annotations

import threading

import pytest

from common.procs import free_port
from server import cli
from server.torchserve import run
from server.torchserve.flags import TORCHSERVE_ONLY, TRITON_ONLY

REFUSED_IN_TORCHSERVE_MODE = [
    (["--repository", "model_repository"], "--repository: ", "--model-store"),
    (["--http-port", "8000"], "--http-port: ", "inference_address"),  # the default, asked for: still refused
    (["--grpc-port", "9001"], "--grpc-port: ", "grpc_inference_port"),
    (["--metrics-port", "9002"], "--metrics-port: ", "metrics_address"),
    (["--host", "0.0.0.0"], "--host: ", "inference_address=http://0.0.0.0:8080"),
    (["--proxy", "on"], "--proxy: ", "ingress"),
    (["--proxy", "auto"], "--proxy: ", "ingress"),
    (["--tls-cert", "cert.pem"], "--tls-cert: ", "ingress"),
    (["--tls-key", "key.pem"], "--tls-key: ", "ingress"),
    (["--token-file", "token"], "--token-file: ", "key_file.json"),
    (["--max-body-mb", "8"], "--max-body-mb: ", "max_request_size"),
    (["--rate-limit", "10"], "--rate-limit: ", "ingress"),
    (["--trusted-proxies", "10.0.0.0/8"], "--trusted-proxies: ", "HAProxy's"),
    (["--max-in-flight", "4"], "--max-in-flight: ", "job_queue_size"),
    (["--queue-ms", "100"], "--queue-ms: ", "job_queue_size"),
    (["--model-control", "explicit"], "--model-control: ", "--enable-model-api"),
]
REFUSED_WITH_REPOSITORY = [["--models", "all"], ["--enable-model-api"], ["--disable-token-auth"], ["--ncs"],
                           ["--keep-snapshots", "5"], ["--snapshot-fallback", "off"],
                           ["--precision", "fp16"], ["--engine", "torch"], ["--handler-path"], ["--trust-model-code"]]


@pytest.fixture
def nothing_starts(monkeypatch):
    def started(*_, **__):
        raise AssertionError("a server was started")
    monkeypatch.setattr(cli, "_torchserve", started)
    monkeypatch.setattr(cli.TritonServer, "start", started)


def test_every_triton_only_flag_is_covered():
    assert {flag[0].removeprefix("--").replace("-", "_") for flag, _, _ in REFUSED_IN_TORCHSERVE_MODE} == set(TRITON_ONLY)
    assert {flag[0].removeprefix("--").replace("-", "_") for flag in REFUSED_WITH_REPOSITORY} == set(TORCHSERVE_ONLY)


@pytest.mark.parametrize("flag,starts,names", REFUSED_IN_TORCHSERVE_MODE, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_a_triton_flag_in_torchserve_mode_is_refused_in_one_line_before_anything_starts(flag, starts, names, tmp_path,
                                                                                      capsys, nothing_starts):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--model-store", str(tmp_path), *flag])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"serve-repo: error: {starts}") and names in err, err


@pytest.mark.parametrize("flag", REFUSED_WITH_REPOSITORY, ids=" ".join)
def test_a_torchserve_flag_without_a_store_is_refused_in_one_line(flag, capsys, nothing_starts):
    with pytest.raises(SystemExit) as exit_:
        cli.main(flag)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"serve-repo: error: {flag[0]}: a TorchServe-mode flag"), err


class FakeServer:
    """Records what serve() asks of tritonserver; starts nothing."""
    made: list["FakeServer"] = []
    http_url, metrics_url, log_file = "unix:/nowhere/http", "unix:/nowhere/metrics", None

    def __init__(self, repository, **options):
        self.repository, self.options, self.timeouts, self.loaded = repository, options, [], []
        FakeServer.made.append(self)

    @classmethod
    def private(cls, repository, **options):
        return cls(repository, **options)

    def start(self, timeout, abort=None):
        self.timeouts.append(timeout)

    def stop(self, keep_log=False):
        pass

    def stubs(self):
        return []


class FakeSupervisor:
    made: list[dict] = []

    def __init__(self, server, **options):
        FakeSupervisor.made.append({"server": server, **options})

    def run(self, stop):
        return 0


class FakeFront:
    def __init__(self, apps, config, services):
        assert set(services) == {"grpc_inference", "grpc_management"}
        self.ready, self.failed = threading.Event(), None
        self.ready.set()

    def start(self):
        pass

    def stop(self):
        pass


def test_the_flags_torchserve_mode_honours_reach_tritonserver_the_supervisor_and_build_repo(tmp_path, monkeypatch,
                                                                                          capsys):
    registries = []

    class Registry(run.Registry):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            registries.append(self)
    FakeServer.made.clear()
    FakeSupervisor.made.clear()
    monkeypatch.setattr(run, "TritonServer", FakeServer)
    monkeypatch.setattr(run, "Supervisor", FakeSupervisor)
    monkeypatch.setattr(run, "Front", FakeFront)
    monkeypatch.setattr(run, "Registry", Registry)
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "config.properties"
    config.write_text(f"model_store={tmp_path}\ndisable_token_authorization=true\n"
                      + "".join(f"{api}_address=http://127.0.0.1:{free_port()}\n"
                                for api in ("inference", "management", "metrics"))
                      + "".join(f"grpc_{api}_port={free_port()}\n" for api in ("inference", "management")))
    status = cli.main(["--torchserve-config", str(config), "--log-file", str(tmp_path / "triton.log"),
                       "--stub-python", "/opt/py/bin/python3", "--timeout", "7", "--canary", "off",
                       "--drain-seconds", "3", "--max-restarts", "2", "--max-unfreed-instances", "1",
                       "--unfreed-grace-s", "4", "--precision", "fp32", "--engine", "torch", "--handler-path",
                       "--proxy", "off", "--trust-model-code", "--", "--log-verbose=1"])
    out = capsys.readouterr().out
    assert status == 0, out
    (server,) = FakeServer.made
    assert server.options == {"log_file": tmp_path / "triton.log", "extra_args": ["--log-verbose=1"],
                              "drain_seconds": 3, "stub_python": run.Path("/opt/py/bin/python3")}
    assert server.timeouts == [7]
    (supervisor,) = FakeSupervisor.made
    assert {k: supervisor[k] for k in ("max_restarts", "start_timeout", "max_unfreed", "unfreed_grace", "canary")} == \
        {"max_restarts": 2, "start_timeout": 7, "max_unfreed": 1, "unfreed_grace": 4, "canary": False}
    (registry,) = registries
    assert registry.canary is False
    assert registry.build_request.options() == ["--precision", "fp32", "--engine", "torch", "--trust-model-code",
                                        "--handler-path"]
    assert out.count("--trust-model-code: not needed in TorchServe mode") == 1, out


def test_without_the_flag_the_store_s_archives_still_run_their_code(tmp_path, monkeypatch):
    """TorchServe's trust: build-repo gets --trust-model-code for every archive the store or allowed_urls admits."""
    registries = []

    class Registry(run.Registry):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            registries.append(self)
    for name, fake in (("TritonServer", FakeServer), ("Supervisor", FakeSupervisor), ("Front", FakeFront),
                       ("Registry", Registry)):
        monkeypatch.setattr(run, name, fake)
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "config.properties"
    config.write_text(f"model_store={tmp_path}\n" + "".join(f"{api}_address=http://127.0.0.1:{free_port()}\n"
                                                           for api in ("inference", "management", "metrics"))
                      + "".join(f"grpc_{api}_port={free_port()}\n" for api in ("inference", "management")))
    assert cli.main(["--torchserve-config", str(config)]) == 0
    assert registries[0].build_request.options() == ["--trust-model-code"]
