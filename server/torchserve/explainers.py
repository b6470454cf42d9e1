"""The image path's explanations: the archive's own handler, as a second Triton model loaded on the first one.

TorchServe's image_classifier answers /explanations with captum's IntegratedGradients, run by its handler's
explain_handle; the image path (BASE_image: decode and forward fused, no handler) cannot. So on a model's first
explanation its archive is built once more on the handler path -- build-repo --from-mar --handler-path --engine
torch: TorchServe's own handler, its model on eager PyTorch as TorchServe runs it -- as BASE_explain, one instance
taking one explanation at a time, and loaded; that model answers the model's explanations from then on. Predictions
never go there: they stay on the image path, in its own stubs, untouched by an explanation in flight. Nothing is
built or loaded until an explanation asks (a stub with torch, captum and a second copy of the weights: hundreds of
MB). BASE_explain is unloaded with the model's other Triton models (scale to 0, unregister); TorchServe's describe,
list and snapshots never name it.
"""
from __future__ import annotations

import asyncio
import shutil
import time

from common.build_request import BuildRequest
from server.errors import ServerError
from server.torchserve.archives import build_registered, link
from server.torchserve.loading import wait_unloaded, write_config
from server.torchserve.refusals import Refusal

# Explanations are rare and slow: IntegratedGradients runs n_steps forwards and backwards per image, all at once. One
# instance, one explanation per handle(): its memory is one image's n_steps (TorchServe's batch would hold a batch's,
# and give every explanation in it the first one's target).
EXPLAINER_INSTANCES = 1


class Explainers:
    """Each registered model's explainer, loaded once on demand (`entry`), unloaded with the model (`unload`)."""

    def __init__(self, registry):
        self.registry = registry  # its server, cache, log and max_pixels
        self._loading: dict[int, asyncio.Future] = {}  # id(model) -> its load in flight (the front's event loop)

    async def entry(self, model) -> str:
        """The Triton model that answers `model`'s explanations, loaded now where it is not: once, in one thread,
        whatever the number of explanations waiting for it (the front's loop answers the rest meanwhile).
        A Refusal where it cannot be (the reason, for the log: the client gets TorchServe's 503); the next
        explanation tries again."""
        if model.explainer is not None:
            return model.explainer
        key = id(model)
        loading = self._loading.get(key)
        if loading is None:
            loading = self._loading[key] = asyncio.ensure_future(asyncio.to_thread(self.load, model))
            loading.add_done_callback(lambda done: (self._loading.pop(key, None),
                                                    done.cancelled() or done.exception()))
        return await asyncio.shield(loading)  # a client gone does not cancel the load others wait for

    def load(self, model) -> str:
        """Build (cached by the archive's checksum, as every build) and load `model`'s explainer; a Refusal where
        it cannot, nothing else changed (its folder removed, Triton's other models as they were)."""
        registry, server = self.registry, self.registry.server
        with model.explainer_lock:  # unload() waits for a load in flight: none is left loaded behind it
            if model.explainer is not None:
                return model.explainer
            if not model.members:  # scaled to 0 or unregistered while this explanation waited
                raise Refusal("the model is no longer served", "InternalServerException")
            name, began = model.explainer_name, time.monotonic()
            request = BuildRequest(engine="torch", trust_model_code=True, handler_path=True, max_batch_size=1,
                                   max_batch_delay_ms=0, name=name)
            loading = False
            try:
                built = build_registered(model.info, model.handler_override, request, registry.cache,
                                         registry.log)[0]
                target = link(built, name, server.repository)
                write_config(built / name / "config.pbtxt", target / "config.pbtxt", EXPLAINER_INSTANCES,
                             at_most=EXPLAINER_INSTANCES, max_pixels=registry.max_pixels)
                loading = True
                server.load(name)
            except (Refusal, ServerError, OSError, ValueError) as exc:
                self._remove(name, loading)
                raise Refusal(f"{name}: {exc}", "InternalServerException") from None
            server.loaded_anew(name)
            server.watch([name])  # the supervisor replaces its dead stubs too
            model.explainer, model.explainer_built = name, built
            registry.log(f"{model.name} {model.version}: explanations answered by {name} (TorchServe's handler "
                         f"{model.info.handler!r}, eager PyTorch), loaded on the first one in "
                         f"{time.monotonic() - began:.1f} s")
            return name

    def unload(self, model) -> None:
        """`model`'s explainer unloaded and its folder removed, where one was loaded (after a load in flight)."""
        with model.explainer_lock:
            name, model.explainer, model.explainer_built = model.explainer, None, None
            if name is None:
                return
            server = self.registry.server
            server.watch([name], False)
            self._remove(name)

    def _remove(self, name: str, loaded: bool = True) -> None:
        """`name` unloaded (where Triton was asked to load it: a failed load may leave it listed), its folder gone."""
        server = self.registry.server
        if loaded:
            try:
                server.unload(name)
            except ServerError as exc:
                self.registry.log(f"unloading {name}: {exc}")
            wait_unloaded(server, [name], self.registry.log)
        shutil.rmtree(server.repository / name, ignore_errors=True)
