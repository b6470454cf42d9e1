"""The TorchServe front's bounds against hostile clients, without a server: Triton names that no two registrations
share, the workers an archive may ask for, max_workers_per_model. Served end to end in tests/test_torchserve_api.py."""
import hashlib
import json
import os
import zipfile
from pathlib import Path

import pytest

from server.torchserve.archives import inspect
from server.torchserve.properties import PropertiesError, settings
from server.torchserve.naming import triton_base, triton_names

# Registered in this order: each pair sanitizes alike, or one's name is another's name plus a suffix Triton's
# names get (`_image`, `_preprocess`, `_vN`), or a hostile name taking the next one's hashed name in advance.
HOSTILE = [("m", "1.0"), ("m", "2.0"), ("m", "2_0"), ("m", "2-0"), ("m_image", "1.0"), ("m_preprocess", "1.0"),
           ("m_v2_0", "1.0"), ("m_v2_0_image", "1.0"), ("m_v3", "1.0"), ("m", "3"), ("n_image", "1.0"), ("n", "1.0"),
           ("m", "2_0_" + "a" * 200), ("m", "2_0_" + "a" * 201)]


def _register(entries: list[tuple[str, str]]) -> dict[tuple[str, str], str]:
    bases, names = {}, set()
    for name, version in entries:
        first = not any(n == name for n, _ in bases)
        base = triton_base(name, version, first, set().union(*(triton_names(b) for b in bases.values())))
        assert base is not None, (name, version)
        bases[(name, version)] = base
    return bases


def test_triton_names_of_registrations_never_overlap_when_they_sanitize_or_suffix_alike():
    bases = _register(HOSTILE)
    for key, base in bases.items():
        others = set().union(*(triton_names(b) for k, b in bases.items() if k != key))
        assert not triton_names(base) & others, (key, base)
    assert bases[("m", "1.0")] == "m" and bases[("m", "2.0")] == "m_v2_0" and bases[("n_image", "1.0")] == "n_image"
    assert bases[("m", "2_0")].startswith("m_v2_0_") and bases[("n", "1.0")].startswith("n_")


def test_triton_base_keeps_the_readable_names_when_nothing_collides():
    assert triton_base("resnet-18", "2.0", True, set()) == "resnet-18"
    assert triton_base("resnet-18", "3.0", False, triton_names("resnet-18")) == "resnet-18_v3_0"


def test_triton_base_is_none_when_every_candidate_is_taken():
    digest = hashlib.sha256(b"m\x002.0").hexdigest()
    candidates = ["m_v2_0", f"m_v2_0_{digest[:8]}", f"m_v2_0_{digest[:32]}"]
    taken = set().union(*(triton_names(base) for base in candidates))
    assert triton_base("m", "2.0", False, taken - triton_names(candidates[2])) == candidates[2]
    assert triton_base("m", "2.0", False, taken) is None


def _mar(folder: Path, config: str | None) -> Path:
    path = folder / "m.mar"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("MAR-INF/MANIFEST.json", json.dumps({"model": {"modelName": "m", "modelVersion": "1.0",
                                                                         "handler": "image_classifier"}}))
        if config is not None:
            archive.writestr("model-config.yaml", config)
    return path


@pytest.mark.parametrize("config, workers", [(None, None), ("minWorkers: 10\nmaxWorkers: 10\n", 10),
                                             ("minWorkers: 10\n", None), ("minWorkers: 4\nmaxWorkers: 2\n", None),
                                             ("minWorkers: 0\nmaxWorkers: 2\n", None), ("minWorkers: [1]\n", None),
                                             ("{{{not yaml", None)])
def test_inspect_takes_an_archives_min_workers_where_torchserve_registers_with_them(tmp_path, config, workers):
    assert inspect(_mar(tmp_path, config), "m.mar").min_workers == workers


def test_max_workers_per_model_is_read_and_defaults_to_the_cpu_count_when_absent(tmp_path: Path):
    config = tmp_path / "config.properties"
    config.write_text("default_workers_per_model=2\n")
    assert settings(config).max_workers == (os.cpu_count() or 1) and settings(config).unsupported == []
    config.write_text("max_workers_per_model=3\n")
    assert settings(config).max_workers == 3 and settings(config).unsupported == []
    config.write_text("max_workers_per_model=0\n")
    with pytest.raises(PropertiesError, match="max_workers_per_model=0: must be >= 1"):
        settings(config)


def test_the_build_cache_keeps_builds_in_use_and_only_the_most_recently_used_others_when_pruned(tmp_path: Path):
    """Issue 42 (cache sizes): each registration's options are part of a build's key, so one archive registered with
    batch sizes 1..1000 left 1000 builds (each with its weights) in the cache."""
    from server.torchserve.archives import prune

    builds = []
    for index in range(12):
        build = tmp_path / f"build{index:02d}"
        (build / "m").mkdir(parents=True)
        os.utime(build, (1_000_000 + index, 1_000_000 + index))  # build11 used last
        builds.append(build)
    (tmp_path / ".staging-in-progress").mkdir()
    removed = prune(tmp_path, in_use={builds[0], builds[1]}, keep=8)
    assert sorted(removed) == builds[2:4]
    assert prune(tmp_path / "no-cache-yet", in_use=set()) == []  # before the first build
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [".staging-in-progress", "build00", "build01"] + [f"build{i:02d}" for i in range(4, 12)])


def test_max_pixels_is_read_and_written_into_every_served_config_when_given(tmp_path: Path):
    """Issue 42 B9: both paths of the TorchServe front bound pixels with build-repo's 50 M; an operator whose clients
    send what TorchServe's handlers decode (up to PIL's 178,956,970) says so in config.properties."""
    from common.modelconfig import read_config, to_text
    from server.torchserve.loading import write_config
    from tritonclient.grpc import model_config_pb2 as mc

    config = tmp_path / "config.properties"
    config.write_text("job_queue_size=4\n")
    assert settings(config).max_pixels is None
    config.write_text("max_pixels=178956970\n")
    assert settings(config).max_pixels == 178_956_970 and settings(config).unsupported == []
    config.write_text("max_pixels=many\n")
    with pytest.raises(PropertiesError, match="max_pixels=many: not an integer"):
        settings(config)
    pbtxt = tmp_path / "config.pbtxt"
    pbtxt.write_text(to_text(mc.ModelConfig(name="m", backend="python", max_batch_size=8)))
    write_config(pbtxt, pbtxt, None)
    assert "max_pixels" not in read_config(pbtxt).parameters  # the model's own (build-repo's 50 M) stays
    write_config(pbtxt, pbtxt, None, max_pixels=178_956_970)
    assert read_config(pbtxt).parameters["max_pixels"].string_value == "178956970"
