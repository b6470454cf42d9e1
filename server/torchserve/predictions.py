"""TorchServe's inference operations on Triton, for REST and gRPC alike: health, a prediction (the image path's:
its image sent to Triton's NAME_image as bytes, answered as TorchServe's image_classifier answers, its top 5; or the
archive's own handler's answer), an explanation (explainers.py), a handler's customized metadata. Each returns a
Prediction or raises a Refusal; what a model has pending is counted here, once."""
from __future__ import annotations

import asyncio
import json
import re
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import tritonclient.http.aio as aioclient
from tritonclient.utils import InferenceServerException

from common.contract import (BODY, CONTENT_TYPE, ENTRIES_PARAMETER, IMAGE_BYTES, LOGITS, RESPONSE, STATUS,
                             STATUS_PARAMETER)
from common.messages import first_line
from server.torchserve.refusals import Refusal, worker
from server.torchserve.registry import Registry
from server.unix_http import aio_client

# Triton not answering at all (its socket closed while serve-repo restarts it: aiohttp's connection errors are
# OSErrors), or not within the response timeout.
UNREACHABLE = (OSError, asyncio.TimeoutError)
TOP_K = 5  # ImageClassifier.topk
PREDICTION_FAILED = "Prediction failed"
# python_backend's error for the requests of a batch its stub held when it died (as in an ensemble's step too)
DEAD_STUB = re.compile(r"Stub process '[^']*' is not healthy")
# Headers not handed to a handler (TorchServe hands it the rest): the token, and what only the connection means.
EXPLAIN = "explain"  # the request header TorchServe's BaseHandler reads: "True" for an explanation
DESCRIBE = "describe"  # and "True" here: its describe_handle answers
NOT_FORWARDED = {"authorization", "host", "connection", "content-length", "transfer-encoding", "expect",
                 "keep-alive", "upgrade"}


@dataclass(frozen=True)
class Prediction:
    """A handler's answer as TorchServe sends it: its body and the content type it set (None: no header)."""
    body: bytes
    content_type: str | None = None


def no_worker(name: str, version: str | None) -> str:
    """TorchServe's refusal of a prediction no worker can take (ApiUtils.getStreamingInferenceErrorResponseMessage:
    the version where the request named one)."""
    named = f'" Version {version}' if version else ""
    return (f'Model "{name}{named}" has no worker to serve inference request. Please use scale workers API to add '
            "workers. If this is a sequence inference, please check if it is closed, or expired; or exceeds "
            "maxSequenceJobQueueSize")


def top5(logits: np.ndarray, labels: dict[str, str] | None) -> dict:
    """ImageClassifier.postprocess: softmax, top 5, each class named by index_to_name.json (else its index)."""
    row = logits.astype(np.float32).reshape(-1)
    exp = np.exp(row - row.max())
    probs = exp / exp.sum(dtype=np.float32)
    order = np.argsort(-probs, kind="stable")[:TOP_K]
    return {(labels[str(i)] if labels is not None else str(i)): float(probs[i]) for i in order}


@contextmanager
def pending(model):
    """`model` has one more request its unregistering waits for (Registry.unregister), while this lasts."""
    model.pending += 1
    try:
        yield
    finally:
        model.pending -= 1


class Predictions:
    """The inference operations on Triton, one aiohttp client for them all."""

    def __init__(self, registry: Registry, triton_url: str, job_queue_size: int, instances=dict, log=print):
        self.registry, self.triton_url, self.job_queue_size, self.log = registry, triton_url, job_queue_size, log
        self.instances = instances  # () -> {Triton model: its live instances}
        self.client: aioclient.InferenceServerClient | None = None  # made in the front's loop (startup)

    async def startup(self) -> None:
        # One client, reused: its aiohttp session keeps connections to Triton open across requests.
        self.client = await aio_client(self.triton_url, conn_limit=512)

    async def shutdown(self) -> None:
        if self.client is not None:
            await self.client.close()

    async def healthy(self) -> bool:
        """Every model ready in Triton with as many live instances as its workers (a dead stub counts until
        serve-repo has replaced it): /ping's and gRPC Ping's answer."""
        alive = await asyncio.to_thread(self.instances)
        for model in self.registry.all():
            if not model.members:  # registered with synchronous=false, still building: its workers are to come
                continue
            try:
                ready = await self.client.is_model_ready(model.entry)
            except (InferenceServerException, OSError):
                ready = False
            if not ready or alive.get(model.triton, 0) < model.workers:
                return False
        return True

    async def predict(self, model, payload, headers, explain: bool = False, entries: dict[str, bytes] | None = None,
                      version: str | None = None) -> Prediction:
        """`payload` predicted by `model` (found), REST's or gRPC's: the bytes, or a coroutine function that reads
        them (REST's body: the request is counted in the model's pending from before its body is read, so that an
        unregistering waits for it). `headers`: those a handler is handed; `explain`: an explanation; `entries`: a
        gRPC input map, which a handler's archive is handed whole (the image path reads `payload`); `version`: the
        version the request named (TorchServe's refusals name it)."""
        with pending(model):
            if callable(payload):
                payload = await payload()
            return await self._predict(model, payload, headers, explain, entries, version)

    async def _predict(self, model, payload: bytes, headers, explain: bool, entries: dict[str, bytes] | None,
                       version: str | None) -> Prediction:
        if model.handler and entries is not None:  # the handler judges them, empty ones too
            payload, headers = b"".join(entries.values()), {
                **headers, ENTRIES_PARAMETER: json.dumps([[name, len(value)] for name, value in entries.items()])}
        elif not payload:  # TorchServe's handler fails on it: the same answer as for any undecodable body
            raise Refusal(PREDICTION_FAILED, "InternalServerException", 503)
        model.queued += 1
        try:
            return await self._queued(model, payload, headers, explain, version)
        finally:
            model.queued -= 1

    async def described(self, model) -> Prediction:
        """The handler's describe_handle() answer (gRPC DescribeModel with `customized`), as TorchServe's worker
        answers it: its JSON (`null` where the handler has none: TorchServe's image_classifier has none, so the image
        path answers that without asking Triton); 503 where the model has no worker."""
        if not model.workers or not model.members:
            raise Refusal("no worker", "ServiceUnavailableException")
        if not model.handler:
            return Prediction(b"null", "application/json")
        with pending(model):
            return await self._handled(model, b"", {DESCRIBE: "True"}, False)

    async def _queued(self, model, payload: bytes, headers, explain: bool, version: str | None) -> Prediction:
        # TorchServe's job queue: job_queue_size requests may wait beyond those its workers hold (a batch each);
        # past that, 503 at once. Counted here, once a request's body is read (as TorchServe queues a request it
        # has received whole: slow bodies do not fill it), not by a Triton queue policy, which would bring back its
        # batcher's 500 ms stall.
        if not model.members or model.queued > self.job_queue_size + model.batch_size * model.workers:
            raise Refusal(no_worker(model.name, version), "ServiceUnavailableException")
        if model.handler:
            return await self._handled(model, payload, headers, explain)
        if explain:  # the image path runs no handler: the archive's own, loaded for explanations (explainers.py)
            try:
                explainer = await self.registry.explainers.entry(model)
            except Refusal as exc:  # TorchServe's answer where a handler fails; the reason in the log
                self.log(f"explanation failed for {model.name}: its explainer could not be loaded: {exc}")
                raise Refusal(PREDICTION_FAILED, "InternalServerException", 503) from None
            return await self._handled(model, payload, headers, explain, explainer)
        return await self._infer(model, payload)

    async def _handled(self, model, payload: bytes, headers, explain: bool, entry: str | None = None) -> Prediction:
        """The archive's own handler (a custom handler's archive; `entry`: the image path's explainer): the body to
        its BODY, its answer as it made it, the request's headers as TorchServe hands them to a handler (with its
        "explain" header: the handler's explain_handle answers where "True"); its failure as TorchServe's worker
        reports it."""
        tensor = aioclient.InferInput(BODY, [1, 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[payload]], dtype=np.object_))
        forwarded = {key: value for key, value in headers.items() if key not in NOT_FORWARDED}
        forwarded.update({"url_path": "", EXPLAIN: str(explain)})  # TorchServe's frontend sets both over the client's
        try:  # with STATUS_PARAMETER the handler's failures come back as STATUS, never as a Triton error
            result = await self.client.infer(entry or model.entry, [tensor],
                                             parameters={**forwarded, STATUS_PARAMETER: "1"},
                                             outputs=[aioclient.InferRequestedOutput(name)
                                                      for name in (RESPONSE, CONTENT_TYPE, STATUS)],
                                             timeout=model.response_timeout * 1_000_000)
        except (InferenceServerException, *UNREACHABLE) as exc:  # Triton down (restarting), the stub dead
            raise self._failed(model, exc) from None
        body = bytes(result.as_numpy(RESPONSE).reshape(-1)[0])
        status = int(result.as_numpy(STATUS).reshape(-1)[0])
        if status != 200:  # a 4xx: the stub refused this request alone (ts_worker.Refused), its type as TorchServe's
            message = body.decode("utf-8", "replace")
            self.log(f"prediction failed for {model.name}: {message[:300]} ({status})")
            raise worker(status, PREDICTION_FAILED if status == 503 else message)
        content_type = result.as_numpy(CONTENT_TYPE).reshape(-1)[0].decode("utf-8", "replace")
        return Prediction(body, content_type or None)

    def _failed(self, model, exc: Exception) -> Refusal:
        """Triton's failure of a prediction as TorchServe answers it (its answer names no reason; its log does, as
        serve-repo's does): 507 "Worker died." for a request in the batch of a stub that died (TorchServe 0.12's
        for a worker killed inside its batch), else 503 "Prediction failed"."""
        said = first_line(exc)
        self.log(f"prediction failed for {model.name}: {said[:300]}")
        if DEAD_STUB.search(said):
            return Refusal("Worker died.", "InternalServerException", 507)
        return Refusal(PREDICTION_FAILED, "InternalServerException", 503)

    async def _infer(self, model, payload: bytes) -> Prediction:
        tensor = aioclient.InferInput(IMAGE_BYTES, [1, 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[payload]], dtype=np.object_))
        try:
            result = await self.client.infer(model.entry, [tensor],
                                             outputs=[aioclient.InferRequestedOutput(LOGITS)],
                                             timeout=model.response_timeout * 1_000_000)
        except (InferenceServerException, *UNREACHABLE) as exc:
            raise self._failed(model, exc) from None
        try:
            answer = top5(result.as_numpy(LOGITS), model.info.labels)
        except (KeyError, ValueError) as exc:  # e.g. a class index_to_name.json lacks: TorchServe's handler fails too
            self.log(f"prediction failed for {model.name}: {first_line(exc)}")
            raise Refusal(PREDICTION_FAILED, "InternalServerException", 503) from None
        # as TorchServe's Python worker prints a handler's answer: json.dumps, beyond ASCII escaped, no content type
        return Prediction(json.dumps(answer, indent=2).encode())
