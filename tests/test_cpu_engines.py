"""perf.cpu_engines: engines x precisions on the image path, served by a real server and in-process."""
import csv
import json

import numpy as np

from perf import cpu_engines


def test_cpu_engines_writes_each_variants_served_and_inprocess_figures_when_run(tmp_path):
    torchserve = tmp_path / "torchserve.json"  # the shape perf.torchserve_bench writes, two levels
    torchserve.write_text(json.dumps({"levels": [{"concurrency": 1, "img_per_s": 4.0, "p50_ms": 250.0},
                                                 {"concurrency": 2, "img_per_s": 5.0, "p50_ms": 400.0}]}))
    status = cpu_engines.main(["--model", "resnet18", "--variants", "openvino:auto", "torch:fp32",
                               "--concurrency", "1", "2", "--seconds", "1", "--no-sweep",
                               "--torchserve", str(torchserve), "--output", str(tmp_path), "--name", "engines"])
    assert status == 0
    result = json.loads((tmp_path / "engines.json").read_text())
    assert result["machine"]["cpu_model"] and isinstance(result["machine"]["isa"], list)
    assert [v["variant"] for v in result["variants"]] == ["openvino:auto", "torch:fp32"]
    for variant in result["variants"]:
        # The stub reports (on Triton's metrics) what the same runner resolves in-process.
        assert variant["precision_served"] == variant["precision_inprocess"] != "?"
        assert set(variant["served_image"]) == {"1", "2"}
        for point in variant["served_image"].values():
            assert point["requests"] > 0 and point["errors"] == 0 and point["avg_batch"] >= 1
        assert variant["inprocess_images_per_s"]["1"] > 0 and variant["inprocess_images_per_s"]["8"] > 0
        assert set(variant["ratios"]) == {"served_over_inprocess_c2", "throughput_c2_over_torchserve",
                                          "p50_c1_over_torchserve"}
        # Each ratio is the two figures of this file divided (NaN-safe: on a loaded machine a 1 s point may
        # see too few completions for a throughput), never a figure from elsewhere.
        served, ratios = variant["served_image"], variant["ratios"]
        assert ratios["p50_c1_over_torchserve"] == served["1"]["p50_ms"] / 250.0 > 0
        assert np.isclose(ratios["throughput_c2_over_torchserve"], served["2"]["throughput"] / 5.0, equal_nan=True)
        same = variant["inprocess_image_path_same_batch"]["2"]
        assert same["images_per_s"] > 0 and same["batch"] >= 1
        assert np.isclose(ratios["served_over_inprocess_c2"], served["2"]["throughput"] / same["images_per_s"],
                          equal_nan=True)
    assert result["variants"][1]["precision_served"] == "fp32"
    with open(tmp_path / "engines.csv") as f:
        assert len(list(csv.DictReader(f))) == 4  # two variants x two concurrencies
    assert (tmp_path / "engines.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_configs_change_only_batching_and_instances_when_built():
    base = {"name": "m", "max_batch_size": 8, "instance_group": [{"count": 1, "kind": "KIND_CPU"}],
            "dynamic_batching": {"default_queue_policy": {"max_queue_size": "128"}}}
    unbatched = cpu_engines.with_batching(base, False, 0, True)
    assert "dynamic_batching" not in unbatched and unbatched["max_batch_size"] == 8
    unbounded = cpu_engines.with_batching(base, True, 2000, False, instances=2)
    assert unbounded["dynamic_batching"] == {"max_queue_delay_microseconds": 2000}
    assert unbounded["instance_group"] == [{"kind": "KIND_CPU", "count": 1, "rate_limiter": {"priority": 1}},
                                           {"kind": "KIND_CPU", "count": 1, "rate_limiter": {"priority": 2}}]
    bounded = cpu_engines.with_batching(base, True, 0, True)
    assert bounded["dynamic_batching"]["default_queue_policy"] == {"max_queue_size": 128}  # a number, as Triton writes it
    assert base["instance_group"][0]["count"] == 1 and "dynamic_batching" in base  # the base is untouched


def test_calibration_folder_holds_photos_other_than_the_served_cat_when_written(tmp_path):
    folder = cpu_engines.calibration_folder(tmp_path / "calibration")
    files = sorted(path.name for path in folder.iterdir())
    assert len(files) == 4 * len(cpu_engines.CALIBRATION) and all(name.endswith(".jpg") for name in files)
    assert not any(name.startswith(("chelsea", "cat")) for name in files)
