"""perf.torchserve_bench's parts that need no TorchServe: the CPU's name and slug, the one-line refusal."""
import pytest

from perf import torchserve_bench


@pytest.mark.parametrize("model, slug", [
    ("AMD EPYC", "amd-epyc"),
    ("Intel(R) Xeon(R) Platinum 8480+ CPU @ 2.00GHz", "intel-xeon-platinum-8480"),
    ("AMD EPYC 9654 96-Core Processor", "amd-epyc-9654"),
    ("", "cpu"),
])
def test_cpu_slug_is_short_and_filename_safe_when_cpuinfo_names_it(model, slug):
    assert torchserve_bench.cpu_slug(model) == slug


def test_cpu_records_every_isa_flag_when_read():
    machine = torchserve_bench.cpu()
    assert set(machine["isa"]) == set(torchserve_bench.ISA)
    assert machine["cores"] >= 1 and machine["model"]


def test_main_refuses_in_one_line_when_java_is_missing(tmp_path, monkeypatch, capsys):
    # JAVA_HOME without a java in it: the same refusal a machine without TorchServe gets (exit 1, one line).
    monkeypatch.setenv("JAVA_HOME", str(tmp_path))
    assert torchserve_bench.main(["--seconds", "1", "--out", str(tmp_path / "out.json")]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and ("java not found" in err or "torchserve not found" in err)
    assert not (tmp_path / "out.json").exists()
