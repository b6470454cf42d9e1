"""Mixed traffic for load and soak runs: good and bad requests to both models (NAME: tensors, NAME_image:
image bytes) over HTTP and gRPC, each good answer checked against the same model run in-process.

Used by drills.loadtest (a fixed number of requests) and drills.soak (a fixed time)."""
from __future__ import annotations

import io
import random
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from common import names
from common.precision import TOLERANCE as TOLERANCES
from perf.samples import CAT

TOLERANCE = TOLERANCES["fp32"]  # largest served-vs-in-process deviation, relative to the logits' scale


@dataclass
class Case:
    """One kind of request: which model and protocol, its inputs, and what must come back."""
    name: str
    model: str
    protocol: str                      # http | grpc
    good: bool
    input_name: str
    datatype: str
    data: np.ndarray
    expected: np.ndarray | None = None  # logits, for good cases


@dataclass
class Tally:
    """Outcomes per case name; `wrong` counts answers that broke the contract."""
    counts: dict = field(default_factory=dict)
    worst_error: float = 0.0
    examples: dict = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, case: Case, outcome: str, detail: str = "", error: float = 0.0) -> None:
        with self.lock:
            per = self.counts.setdefault(case.name, {})
            per[outcome] = per.get(outcome, 0) + 1
            self.worst_error = max(self.worst_error, error)
            if outcome != "ok" and detail:
                self.examples.setdefault(f"{case.name}: {outcome}", detail[:300])

    def total(self, outcome: str | None = None) -> int:
        with self.lock:
            return sum(n for per in self.counts.values() for o, n in per.items() if outcome in (None, o))


def _encode(image, fmt: str, **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **kwargs)
    return buffer.getvalue()


def build_cases(model_name: str, reference, transform, seed: int = 0) -> list[Case]:
    """Good and bad cases for both models and both protocols. `reference(batch) -> logits` runs the
    model in-process; `transform` is the served preprocessing (clients.classify.preprocess_for)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    photo = Image.open(CAT).convert("RGB")
    images = {
        "jpeg": CAT.read_bytes(),
        "png-small": _encode(photo.resize((160, 120)), "PNG"),
        "jpeg-gray": _encode(photo.convert("L"), "JPEG", quality=90),
    }
    tensors = {f"batch{n}": rng.standard_normal((n, 3, 224, 224)).astype(np.float32) for n in (1, 2)}
    bad_tensors = {
        "wrong-shape": (rng.standard_normal((1, 3, 100, 100)).astype(np.float32), "FP32", "IMAGE"),
        "wrong-dtype": (rng.standard_normal((1, 3, 224, 224)), "FP64", "IMAGE"),
        "wrong-name": (rng.standard_normal((1, 3, 224, 224)).astype(np.float32), "FP32", "PIXELS"),
    }
    jpeg = images["jpeg"]
    bad_images = {"random-bytes": rng.bytes(2048), "truncated-jpeg": jpeg[: len(jpeg) // 3],
                  "text": b"this is not an image", "empty": b""}
    cases = []
    for protocol in ("http", "grpc"):
        for label, batch in tensors.items():
            cases.append(Case(f"{model_name}/{protocol}/good-{label}", model_name, protocol, True, "IMAGE",
                              "FP32", batch, reference(batch)))
        for label, (batch, dtype, name) in bad_tensors.items():
            cases.append(Case(f"{model_name}/{protocol}/bad-{label}", model_name, protocol, False, name,
                              dtype, batch))
        for label, blob in images.items():
            with Image.open(io.BytesIO(blob)) as decoded:
                expected = reference(transform(decoded.convert("RGB")).unsqueeze(0).numpy())
            cases.append(Case(f"{names.image_model(model_name)}/{protocol}/good-{label}", names.image_model(model_name), protocol,
                              True, "IMAGE_BYTES", "BYTES", np.array([[blob]], dtype=object), expected))
        for label, blob in bad_images.items():
            cases.append(Case(f"{names.image_model(model_name)}/{protocol}/bad-{label}", names.image_model(model_name), protocol,
                              False, "IMAGE_BYTES", "BYTES", np.array([[blob]], dtype=object)))
    return cases


class Sender:
    """One worker's clients (one HTTP, one gRPC); send(case) records exactly one outcome per call."""

    def __init__(self, http_url: str, grpc_url: str, tally: Tally, timeout: float = 300):
        import tritonclient.grpc as grpcclient
        import tritonclient.http as httpclient

        self.modules = {"http": httpclient, "grpc": grpcclient}
        self.clients = {"http": httpclient.InferenceServerClient(http_url, network_timeout=timeout,
                                                                 connection_timeout=timeout),
                        "grpc": grpcclient.InferenceServerClient(grpc_url)}
        self.tally = tally
        self.timeout = timeout

    def send(self, case: Case) -> str:
        module, client = self.modules[case.protocol], self.clients[case.protocol]
        tensor = module.InferInput(case.input_name, list(case.data.shape), case.datatype)
        tensor.set_data_from_numpy(case.data)
        kwargs = {"client_timeout": self.timeout} if case.protocol == "grpc" else {}
        try:
            result = client.infer(case.model, [tensor], **kwargs)
            logits = result.as_numpy("LOGITS")
        except Exception as exc:  # noqa: BLE001 - every outcome is recorded, none lost
            message = str(exc)
            if case.good:
                outcome = "error"
            else:
                refused = ("400" in message or "INVALID_ARGUMENT" in message or "invalid" in message.lower()
                           or "unexpected" in message.lower())
                outcome = "refused" if refused else "error"
            self.tally.add(case, outcome, message)
            return outcome
        if not case.good:
            self.tally.add(case, "accepted-bad", f"shape {None if logits is None else logits.shape}")
            return "accepted-bad"
        if logits is None or logits.shape != case.expected.shape:
            self.tally.add(case, "wrong", f"shape {None if logits is None else logits.shape}")
            return "wrong"
        error = float(np.abs(logits - case.expected).max() / np.abs(case.expected).max())
        outcome = "ok" if error <= TOLERANCE else "wrong"
        self.tally.add(case, outcome, f"relative error {error:.2e}", error)
        return outcome

    def close(self) -> None:
        for client in self.clients.values():
            try:
                client.close()
            except Exception:  # noqa: BLE001
                pass


def schedule(cases: list[Case], count: int, good_share: float = 0.7, seed: int = 0) -> list[Case]:
    """`count` cases, `good_share` of them good, spread evenly over the good and the bad kinds."""
    rnd = random.Random(seed)
    good = [c for c in cases if c.good]
    bad = [c for c in cases if not c.good]
    n_good = round(count * good_share)
    picked = [good[i % len(good)] for i in range(n_good)] + [bad[i % len(bad)] for i in range(count - n_good)]
    rnd.shuffle(picked)
    return picked


def reference_for(model_name: str, seed: int):
    """What `build-repo --weights random --seed SEED` serves, in-process: batch -> logits."""
    import torch
    import torchvision

    torch.manual_seed(seed)
    model = torchvision.models.get_model(model_name, weights=None).eval()

    def run(batch: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return model(torch.from_numpy(np.ascontiguousarray(batch, dtype=np.float32))).numpy()
    return run


def process_memory(pid: int, field: str = "VmRSS") -> int:
    """Bytes of /proc/PID/status `field`: VmRSS (all resident pages, shared memory included) or RssAnon
    (the process's own heap and stacks); 0 if the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
