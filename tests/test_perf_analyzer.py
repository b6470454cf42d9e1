"""Triton's own load generator, installed by setup, drives our models."""
import subprocess
import sys
from pathlib import Path

from conftest import SMALL

PERF_ANALYZER = Path(sys.executable).parent / "perf_analyzer"


def test_perf_analyzer_reports_throughput_when_run_against_the_classifier(server):
    assert PERF_ANALYZER.is_file(), "setup installs it: clients/install_perf_analyzer.sh"
    result = subprocess.run(
        [str(PERF_ANALYZER), "-m", SMALL, "-u", server.http_url, "-i", "http", "-b", "1",
         "--shape", "IMAGE:3,224,224", "--concurrency-range", "2", "--measurement-mode", "count_windows",
         "--measurement-request-count", "8", "--max-trials", "3", "--stability-percentage", "100"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "Throughput:" in result.stdout and "infer/sec" in result.stdout
