"""The torch engine (TorchServe's own) in bf16 on a CPU instance: run where the CPU has it, refused elsewhere."""
import numpy as np
import pytest
import torch

from backends import classifier
from backends.engines import cpu_bf16
from common.modelconfig import parameters, read_config
from common.precision import TOLERANCE
from support import SMALL, build, reference_logits, reference_model, relative_error

# bf16 keeps 8 bits of mantissa; weights and activations both in bf16 move ResNet-18's logits by ~1e-2
# of their range (measured on random inputs), fp32 by 1e-6.
BF16_TOLERANCE = TOLERANCE["bf16"]


def _torch_params(repository, precision: str) -> dict:
    return {**parameters(read_config(repository / SMALL)), "engine": "torch", "precision": precision}


def _runner(repository, precision: str):
    return classifier.build_runner(repository / SMALL / "1", _torch_params(repository, precision),
                                   torch.device("cpu"), 8, (3, 224, 224))


@pytest.mark.skipif(not cpu_bf16(), reason="this CPU has neither AMX-BF16 nor AVX512-BF16 (the refusal is "
                                           "tested below on every CPU)")
def test_torch_engine_bf16_on_cpu_keeps_the_fp32_logits_when_the_cpu_has_bf16(repository):
    images = np.random.default_rng(0).standard_normal((3, 3, 224, 224)).astype(np.float32)
    runner = _runner(repository, "bf16")
    assert runner.dtype == torch.bfloat16
    logits = runner.run([torch.from_numpy(images[:2]), torch.from_numpy(images[2:])])
    assert logits.dtype == torch.float32 and logits.shape == (3, 1000)
    expected = reference_logits(reference_model(), images)
    assert relative_error(logits.numpy(), expected) < BF16_TOLERANCE
    assert (logits.argmax(1).numpy() == expected.argmax(1)).all()


def test_torch_engine_refuses_bf16_at_load_when_the_cpu_lacks_it(repository, monkeypatch):
    monkeypatch.setattr(classifier, "cpu_bf16", lambda: False)
    with pytest.raises(ValueError, match="needs a CPU with AMX or AVX512-BF16"):
        _runner(repository, "bf16")
    assert _runner(repository, "fp32").dtype == torch.float32  # fp32 still loads on that CPU


def test_cpu_bf16_follows_the_cpu_flags_when_read():
    flags = open("/proc/cpuinfo").read().split()
    assert cpu_bf16() == ("amx_bf16" in flags or "avx512_bf16" in flags)


def test_build_repo_writes_bf16_for_the_torch_engine_on_cpu_when_asked(tmp_path):
    build(tmp_path, "--kind", "cpu", "--engine", "torch", "--precision", "bf16", "--formats", "python")
    params = parameters(read_config(tmp_path / SMALL))
    assert (params["engine"], params["precision"]) == ("torch", "bf16")
