"""One checked request per served model before serve-repo says ready: the answer's shape, dtype, finiteness.

Why: Triton says READY when a model's stub has started, not when it answers. python_backend r24.10's stub with
NumPy 2 in its Python loaded every model and then answered every FP32 output empty and read BYTES inputs as
garbage (docs/serve-repo.md). So each model gets ONE request built from the config Triton serves it with: zeros of
each declared numeric input (batch 1), a tiny generated JPEG for IMAGE_BYTES. A model whose inputs cannot be made
up (a TorchServe custom handler's BODY: the project has no declared test input) is skipped, and said so. A step of
a loaded ensemble that outputs no LOGITS (NAME_preprocess) is not probed alone: its ensemble's probe goes through it.
"""
from __future__ import annotations

import io
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException, triton_to_np_dtype

from common.contract import IMAGE_BYTES, LOGITS
from common.messages import first_line
from common.modelconfig import mc
from server.errors import ServerError
from server.unix_http import sync_client

TIMEOUT = 300  # seconds for one canary answer: a first request may warm an engine up on a busy 2-core machine
FREE_DIM = 64  # a variable (-1) dimension of an input gets this size (build-repo writes none)


class CanaryFailed(ServerError):
    """A model answered its canary wrong (or not at all); str() is one line naming the model and its answer."""

    def __init__(self, model: str, message: str):
        super().__init__(message)
        self.model = model


@dataclass
class Report:
    probed: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # model -> why it was not probed
    through: dict[str, str] = field(default_factory=dict)  # ensemble step -> the probed ensemble that covers it
    seconds: float = 0.0

    def line(self) -> str:
        """The log line: which models answered right and in how long, which were skipped and why."""
        text = (f"canary: {', '.join(self.probed)} answered right ({self.seconds:.2f}s)" if self.probed
                else "canary: nothing probed")
        if self.through:
            text += "; " + ", ".join(f"{step} through {ensemble}" for step, ensemble in self.through.items())
        for model, why in self.skipped.items():
            text += f"; {model} not probed: {why}"
        return text


def _datatype(tensor: mc.ModelInput | mc.ModelOutput) -> str:
    """The tensor's datatype as the inference protocol names it (TYPE_STRING is BYTES; unset: FP32)."""
    name = mc.DataType.Name(tensor.data_type or mc.TYPE_FP32).removeprefix("TYPE_")
    return "BYTES" if name == "STRING" else name


def tiny_jpeg() -> bytes:
    """A 32x32 JPEG made here (PIL): the image path decodes, resizes and crops it like any photo."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (32, 32), (124, 116, 104)).save(buffer, format="JPEG")
    return buffer.getvalue()


def canary_inputs(config: mc.ModelConfig) -> list[httpclient.InferInput] | str:
    """The canary request's inputs for `config` (the served config), or why none can be made up."""
    batched = config.max_batch_size > 0
    inputs = []
    for tensor in config.input:
        if tensor.optional:
            continue
        name, datatype = tensor.name, _datatype(tensor)
        shape = ([1] if batched else []) + [FREE_DIM if d < 0 else d for d in tensor.dims]
        if datatype == "BYTES":
            if name != IMAGE_BYTES:
                return f"input {name} is bytes of no declared test input (a custom handler's request body)"
            data = np.full(shape, tiny_jpeg(), dtype=np.object_)
        else:
            data = np.zeros(shape, dtype=triton_to_np_dtype(datatype))
        item = httpclient.InferInput(name, shape, datatype)
        item.set_data_from_numpy(data, binary_data=True)
        inputs.append(item)
    return inputs


def _shown(array: np.ndarray) -> str:
    flat = array.reshape(-1)
    values = np.array2string(flat[:4], precision=4, separator=" ") if flat.dtype != np.object_ else repr(flat[:1])
    return f"{array.dtype} shape {tuple(array.shape)} {values}{' ...' if flat.size > 4 else ''}"


def wrong(config: mc.ModelConfig, outputs: dict[str, np.ndarray]) -> str | None:
    """What is wrong with a batch-1 answer to `config`'s model, in one phrase naming the output and showing it;
    None when every declared output has its shape (-1: any size), dtype, is not empty and, floats, is finite."""
    batched = config.max_batch_size > 0
    for tensor in config.output:
        name, datatype = tensor.name, _datatype(tensor)
        array = outputs.get(name)
        if array is None:
            return f"{name} missing"
        expected = ([1] if batched else []) + list(tensor.dims)
        dtype = np.dtype(triton_to_np_dtype(datatype))
        if array.size == 0:
            return f"{name} empty: {_shown(array)}, expected shape {tuple(expected)}"
        if len(array.shape) != len(expected) or any(e >= 0 and a != e for a, e in zip(array.shape, expected)):
            return f"{name} {_shown(array)}, expected shape {tuple(expected)}"
        if array.dtype != dtype and not (dtype == np.object_ and array.dtype.kind in "OSU"):
            return f"{name} {_shown(array)}, expected dtype {dtype}"
        if array.dtype.kind in "fc" and not np.isfinite(array).all():
            bad = int((~np.isfinite(array)).sum())
            return f"{name} {_shown(array)}: {bad} of {array.size} values not finite"
    return None


def probe(url: str, model: str, config: mc.ModelConfig, timeout: float = TIMEOUT) -> str | None:
    """Send `model` its canary; raise CanaryFailed where the answer is wrong or an error. Returns why it was not
    probed (its inputs cannot be made up), else None."""
    inputs = canary_inputs(config)
    if isinstance(inputs, str):
        return inputs
    outputs = [httpclient.InferRequestedOutput(t.name, binary_data=True) for t in config.output]
    client = sync_client(url, connection_timeout=min(timeout, 10.0), network_timeout=timeout)
    try:
        result = client.infer(model, inputs, outputs=outputs)
        answer = {t.name: result.as_numpy(t.name) for t in config.output}
    except InferenceServerException as error:
        raise CanaryFailed(model, f"model {model} failed its canary request: {first_line(error)[:300]}") from None
    except (OSError, ValueError) as error:  # the body did not parse into the declared tensors (an empty FP32 output)
        raise CanaryFailed(model, f"model {model} answered wrong to the canary: {first_line(error)[:300]}") from None
    finally:
        client.close()
    problem = wrong(config, {k: v for k, v in answer.items() if v is not None})
    if problem:
        raise CanaryFailed(model, f"model {model} answered wrong to the canary: {problem}")
    return None


def targets(configs: dict[str, mc.ModelConfig], changed: list[str] | None = None) -> list[str]:
    """Which of the models in `configs` (name -> its served config) to probe: every one but an ensemble's step
    that outputs no LOGITS (its ensemble's probe goes through it). With `changed`, only those and the loaded
    ensembles that go through one of them."""
    steps = {name: {step.model_name for step in config.ensemble_scheduling.step} for name, config in configs.items()}
    inside = set().union(*steps.values()) if steps else set()
    wanted = [name for name, config in configs.items()
              if name not in inside or any(t.name == LOGITS for t in config.output)]
    if changed is None:
        return wanted
    return [name for name in wanted if name in changed or steps[name] & set(changed)]


def run(server, changed: list[str] | None = None, models: list[str] | None = None, timeout: float = TIMEOUT) -> Report:
    """Probe `models` (default: all `server` loaded; `server` a started TritonServer), all at once (one thread
    each: a stub per model answers while the others do); with `changed`, only what a reload of those models
    affects. Raises CanaryFailed for the first wrong answer (in the order of `models`), after every probe ended;
    ServerError where Triton does not give a model's config."""
    from server.triton import release_thread_hub

    started = time.monotonic()
    report = Report()
    configs: dict[str, mc.ModelConfig] = {}
    for name in server.loaded if models is None else models:
        try:
            configs[name] = server.model_config(name)
        except ServerError as error:
            if changed is None or name in changed:
                raise
            # Not ours to judge: e.g. an ensemble Triton unloaded when its step was loaded anew from a new build.
            report.skipped[name] = f"not available now ({error})"
    chosen = targets(configs, changed)
    results: dict[str, str | None | CanaryFailed] = {}

    def one(model: str) -> None:
        try:
            results[model] = probe(server.http_url, model, configs[model], timeout)
        except CanaryFailed as failure:
            results[model] = failure
        except Exception as error:  # noqa: BLE001 - whatever stopped the probe, the model is not shown right
            results[model] = CanaryFailed(model, f"model {model}: its canary could not be checked: {first_line(error)}")
        finally:
            release_thread_hub()

    threads = [threading.Thread(target=one, args=(model,), daemon=True) for model in chosen]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for model in chosen:
        outcome = results.get(model, CanaryFailed(model, f"model {model}: its canary never ended"))
        if isinstance(outcome, CanaryFailed):
            raise outcome
        if outcome:
            report.skipped[model] = outcome
        else:
            report.probed.append(model)
    for name in chosen:
        for step in configs[name].ensemble_scheduling.step:
            if step.model_name not in chosen:
                report.through.setdefault(step.model_name, name)
    report.seconds = time.monotonic() - started
    return report
