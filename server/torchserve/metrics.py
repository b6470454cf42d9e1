"""TorchServe's metrics port: its Prometheus counters (ts_inference_requests_total, ts_inference_latency_microseconds,
ts_queue_latency_microseconds) computed from Triton's own statistics, followed by Triton's own metrics."""
from __future__ import annotations

import asyncio
import socket

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from tritonclient.utils import InferenceServerException

from server.torchserve import openapi
from server.torchserve.registry import Registry
from server.torchserve.replies import HANDLERS
from server.unix_http import aio_client, get

COUNTERS = (
    ("ts_inference_requests_total", "Total number of inference requests."),
    ("ts_inference_latency_microseconds", "Cumulative inference duration in microseconds"),
    ("ts_queue_latency_microseconds", "Cumulative queue duration in microseconds"),
)


HOSTNAME = socket.gethostname()


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class Metrics:
    def __init__(self, registry: Registry, triton_url: str, triton_metrics_url: str):
        self.registry, self.triton_url, self.triton_metrics_url = registry, triton_url, triton_metrics_url

    async def _stats(self, client, model) -> tuple[float, float, float]:
        """(requests answered, their latency in us, their time queued in us) of one model, as Triton counts them:
        the image model's requests and its explainer's; the time spent and queued in every model it runs."""
        requests = latency = queued = 0.0
        explainer = model.explainer
        for member in [*model.members, *([explainer] if explainer else [])]:
            try:
                stats = (await client.get_inference_statistics(member))["model_stats"]
            except (InferenceServerException, OSError, KeyError):
                continue
            for entry in stats:
                inference = entry.get("inference_stats", {})
                queued += float(inference.get("queue", {}).get("ns", 0)) / 1000
                # an ensemble counts its requests but not their time: that is its models'
                latency += float(inference.get("success", {}).get("ns", 0)) / 1000
                if member in (model.entry, explainer):
                    requests += float(inference.get("success", {}).get("count", 0))
                    requests += float(inference.get("fail", {}).get("count", 0))
        return requests, latency, queued

    async def metrics(self, request: Request) -> Response:
        client = await aio_client(self.triton_url)
        try:
            rows = [(model, await self._stats(client, model)) for model in self.registry.all()]
        finally:
            await client.close()
        lines = []
        for index, (name, help_text) in enumerate(COUNTERS):
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter"]
            for model, values in rows:
                lines.append(f'{name}{{model_name="{_escape(model.name)}",model_version="{_escape(model.version)}",'
                             f'hostname="{_escape(HOSTNAME)}",}} {values[index]:.1f}')
        triton = await asyncio.to_thread(self._triton_metrics)
        return Response("\n".join(lines) + "\n" + triton, media_type="text/plain; version=0.0.4; charset=utf-8")

    def _triton_metrics(self) -> str:
        try:
            return get(self.triton_metrics_url, "/metrics", timeout=5).decode()
        except OSError:
            return ""

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/metrics", self.metrics, methods=["GET"]), *openapi.routes("metrics")],
                         exception_handlers=HANDLERS)
