"""perf.tune reloads candidates live on an explicit-mode server and writes a config that loads."""
import shutil

import pytest
import tritonclient.http as httpclient

from common.modelconfig import read_config
from server.triton import TritonServer
from perf import tune
from support import SMALL


@pytest.fixture(scope="module")
def explicit_server(repository, tmp_path_factory):
    repo = tmp_path_factory.mktemp("tune") / "repo"
    repo.mkdir()
    shutil.copytree(repository / SMALL, repo / SMALL)
    with TritonServer.local(repo, model_control="explicit") as server:
        yield server


def _served(url: str) -> dict:
    return httpclient.InferenceServerClient(url).get_model_config(SMALL)


def test_tune_writes_a_config_that_loads_when_searching_under_a_budget(explicit_server, tmp_path, capsys):
    output = tmp_path / "tuned.pbtxt"
    status = tune.main(["--url", explicit_server.http_url, "--model", SMALL, "--concurrency", "4",
                        "--batch-sizes", "0", "4", "--delays-us", "0", "2000", "--seconds", "2",
                        "--p99-ms", "60000", "--output", str(output)])
    assert status == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line[:2] in ("* ", "  ") and line[2:].strip()[:1].isdigit()]
    assert len(rows) == 3  # unbatched once, batch 4 with two delays
    assert sum(line.startswith("* ") for line in rows) == 1
    written = read_config(output)
    assert written.name == SMALL and written.max_batch_size in (0, 4)
    client = httpclient.InferenceServerClient(explicit_server.http_url)
    from google.protobuf.json_format import MessageToJson

    client.load_model(SMALL, config=MessageToJson(written, preserving_proto_field_name=True))
    assert client.is_model_ready(SMALL)
    assert _served(explicit_server.http_url)["max_batch_size"] == written.max_batch_size


def test_tune_reconfigure_applies_torchserve_settings_live_when_asked(explicit_server, capsys):
    status = tune.main(["--url", explicit_server.http_url, "--model", SMALL, "--reconfigure",
                        "--batch-size", "4", "--max-batch-delay-ms", "50"])
    assert status == 0
    served = _served(explicit_server.http_url)
    assert served["max_batch_size"] == 4
    assert int(served["dynamic_batching"]["max_queue_delay_microseconds"]) == 50_000
    assert "max_batch_size=4 max_queue_delay_microseconds=50000" in capsys.readouterr().out


def test_tune_exits_2_naming_the_field_when_reconfigure_values_are_invalid(explicit_server, capsys):
    status = tune.main(["--url", explicit_server.http_url, "--model", SMALL, "--reconfigure",
                        "--batch-size", "-3"])
    assert status == 2
    assert "`max_batch_size` must be >= 0" in capsys.readouterr().err
    assert httpclient.InferenceServerClient(explicit_server.http_url).is_model_ready(SMALL)


def test_tune_explains_explicit_mode_when_server_forbids_live_loading(server, capsys):
    if "127.0.0.1" not in server.http_url:
        pytest.skip("the external server's model-control mode is not ours to know")
    status = tune.main(["--url", server.http_url, "--model", SMALL, "--reconfigure", "--batch-size", "8"])
    assert status == 1
    assert "--model-control explicit" in capsys.readouterr().err
