"""TorchServe's config.properties read as Java reads it, and the settings serve-repo takes from it."""
from pathlib import Path

import pytest

from server.torchserve.properties import PropertiesError, parse, settings


def test_parse_reads_comments_separators_continuations_and_escapes_when_java_would():
    text = ("# a comment\n! another\n  inference_address = http://0.0.0.0:9080\nmodel_store:/srv/store\n"
            "models={\\\n  \"a\": {\"1.0\": {\"batchSize\": 4}}\\\n}\nspaced value\\u0041 x\nempty=\n")
    assert parse(text) == {"inference_address": "http://0.0.0.0:9080", "model_store": "/srv/store",
                           "models": '{"a": {"1.0": {"batchSize": 4}}}', "spaced": "valueA x", "empty": ""}


def test_settings_take_the_keys_served_and_name_the_others_when_read(tmp_path: Path):
    config = tmp_path / "config.properties"
    config.write_text("inference_address=http://0.0.0.0:9080\nmodel_store=store\nload_models=a.mar,b=b.mar\n"
                      "job_queue_size=7\nnumber_of_netty_threads=4\nenable_model_api=true\nmax_response_size=100\n")
    result = settings(config)
    assert result.inference == ("0.0.0.0", 9080) and result.management == ("127.0.0.1", 8081)
    assert result.model_store == tmp_path / "store" and result.load_models == ["a.mar", "b=b.mar"]
    assert result.job_queue_size == 7 and result.enable_model_api and result.token_auth
    # max_response_size was parsed and then read nowhere, while the docs promised every unserved key a log line
    assert result.unsupported == ["max_response_size", "number_of_netty_threads"]


@pytest.mark.parametrize("line, why", [("inference_address=https://0.0.0.0:8443", "only http"),
                                       ("job_queue_size=lots", "not an integer"),
                                       ("models={not json", "not JSON")])
def test_settings_refuse_what_cannot_be_served_in_one_line_when_read(tmp_path: Path, line, why):
    config = tmp_path / "config.properties"
    config.write_text(line + "\n")
    with pytest.raises(PropertiesError, match=why):
        settings(config)
