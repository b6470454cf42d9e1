"""A CUDA fault is sticky: the stub answers that batch with errors, then exits so that its instance is replaced."""
import torch

from backends import classifier, preprocess, triton_io


class _Faulting:
    def run(self, parts):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


class _Failing:
    def run(self, parts):
        raise ValueError("a bad tensor")


def _model(runner):
    model = classifier.TritonPythonModel.__new__(classifier.TritonPythonModel)
    model.runner, model.batched = runner, True
    return model


def test_device_fault_fails_the_batch_and_ends_the_stub_when_the_forward_raises_it(monkeypatch):
    exits = []
    monkeypatch.setattr(classifier, "error_response", lambda message, invalid: ("error", message, invalid))
    monkeypatch.setattr(classifier, "exit_soon", exits.append)
    responses = _model(_Faulting())._infer([torch.zeros(1, 3, 4, 4), torch.zeros(2, 3, 4, 4)])
    assert [r[0] for r in responses] == ["error", "error"] and not any(r[2] for r in responses)
    assert len(exits) == 1 and "illegal memory access" in exits[0]


def test_ordinary_failure_is_retried_one_by_one_and_the_stub_stays_when_no_device_faulted(monkeypatch):
    exits = []
    monkeypatch.setattr(classifier, "error_response", lambda message, invalid: ("error", message, invalid))
    monkeypatch.setattr(classifier, "exit_soon", exits.append)
    responses = _model(_Failing())._infer([torch.zeros(1, 3, 4, 4), torch.zeros(1, 3, 4, 4)])
    assert [r[0] for r in responses] == ["error", "error"] and exits == []


def test_preprocess_device_fault_ends_the_stub_when_decoding_raises_it(monkeypatch):
    exits = []
    monkeypatch.setattr(preprocess, "exit_soon", exits.append)
    monkeypatch.setattr(preprocess, "encoded_elements", lambda requests, name: ([b"x"], [0], [None]))
    monkeypatch.setattr(preprocess, "error_response", lambda message, invalid: ("error", message))

    def faulting(elements):
        raise RuntimeError("CUDA error: unspecified launch failure")
    responses, images = preprocess.preprocessed(faulting, ["request"])
    assert responses[0][0] == "error" and images == [None] and len(exits) == 1


def test_exit_soon_exits_with_ex_software_after_the_delay_when_called():
    codes = []
    triton_io.exit_soon("CUDA error: test", delay=0.01, exit=codes.append).join(5)
    assert codes == [70]


def test_device_fault_is_told_apart_from_other_errors_when_classified():
    assert triton_io.device_fault(RuntimeError("CUDA error: device-side assert triggered"))
    assert triton_io.device_fault(RuntimeError("cuDNN error: CUDNN_STATUS_EXECUTION_FAILED"))
    assert not triton_io.device_fault(ValueError("IMAGE must have shape [N, 3, 224, 224]"))


def test_stream_ordering_is_a_no_op_when_every_part_is_on_the_cpu():
    from backends.batch_runner import ordered_after_producers

    class Refusing:  # any use of the stream would fail the test
        def __getattr__(self, name):
            raise AssertionError(f"stream.{name} used for CPU parts")
    ordered_after_producers(Refusing(), [torch.zeros(1, 3, 4, 4)])
