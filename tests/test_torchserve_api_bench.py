"""perf.torchserve_api at a tiny scale (resnet18 only, TorchServe left out, 2 s points): the result file's keys and
figures, no speed threshold."""
import json

from perf import torchserve_api


def test_main_writes_every_key_with_positive_figures_when_run_on_resnet18_only(tmp_path):
    out = tmp_path / "api.json"
    assert torchserve_api.main(["--models", "resnet18", "--skip-torchserve", "--seconds", "2", "--warmup", "1",
                                "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result) >= {"machine", "command", "seconds", "resnet152", "resnet18", "ratios", "targets"}
    assert result["command"].startswith("python -m perf.torchserve_api --models resnet18")
    assert result["machine"]["cpu"]["model"] and result["machine"]["tritonserver"]
    assert result["resnet152"] is None
    r18 = result["resnet18"]
    assert r18["ours_c32_images_per_s"] > 0 and r18["direct_c32_images_per_s"] > 0
    assert r18["ours"]["registered"] == torchserve_api.REGISTRATION
    assert r18["ours"]["points"]["c32"]["errors"] == 0 and r18["direct"]["points"]["c32"]["errors"] == 0
    assert r18["direct"]["same_top1_as_api"] is True
    assert set(result["targets"]) == set(torchserve_api.TARGETS) <= set(result["ratios"])  # and eager's, no target
    assert {"handler_eager_c8_over_torchserve", "handler_eager_c1_p50_over_torchserve"} <= set(result["ratios"])
    assert result["ratios"]["resnet18_api_over_direct_c32"] > 0
    assert result["targets"]["resnet18_api_over_direct_c32"]["met"] in (True, False)
    assert result["targets"]["fp32_c8_over_torchserve"] == {"target": ">= 1.15", "value": None, "met": None}
    text = out.read_text().replace(str(out), "OUT")  # the command names the --out given, as a user typed it
    assert "/tmp/" not in text and "/work/" not in text
