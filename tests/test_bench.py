"""perf.bench --quick drives a real server and writes JSON, CSV and PNG plots."""
import json

from perf import bench


def test_bench_quick_writes_json_csv_and_png_when_run(tmp_path, capsys):
    status = bench.main(["--quick", "--seconds", "2", "--concurrency", "1", "4", "--output", str(tmp_path)])
    assert status == 0
    result = json.loads((tmp_path / "cpu-resnet18.json").read_text())
    configs = {p["config"] for p in result["points"]}
    assert configs == {"unbatched", "default b8 d0"}
    assert {p["concurrency"] for p in result["points"]} == {1, 4}
    for point in result["points"]:
        assert point["requests"] > 0 and point["errors"] == 0 and point["throughput"] > 0
        assert point["p50_ms"] <= point["p95_ms"] <= point["p99_ms"]
    unbatched = [p for p in result["points"] if p["config"] == "unbatched"]
    assert all(abs(p["avg_batch"] - 1.0) < 1e-9 for p in unbatched)  # batching off: one image per execution
    assert result["inprocess_images_per_s"][result["engines"][0]]["1"] > 0
    assert "p50_c1_default_over_unbatched" in result
    assert (tmp_path / "cpu-resnet18.csv").read_text().startswith("config,concurrency")
    for plot in ("cpu-resnet18-throughput.png", "cpu-resnet18-latency.png"):
        assert (tmp_path / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
