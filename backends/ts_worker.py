"""TorchServe's worker in-process: an archive's handler loaded, one batch run and answered, as ts/ does it.

build-repo copies this file beside the handler model's model.py; it imports only TorchServe's `ts` package
(pinned with torchserve) and no module of ours, so that no name of ours shadows one of the archive's.
"""
from __future__ import annotations

import io
import json
import logging
import os
import sys
import re
import time
import uuid
import warnings
from dataclasses import dataclass

import ts
from ts.context import RequestProcessor
from ts.metrics.metric_cache_yaml_impl import MetricsCacheYamlImpl
from ts.model_loader import TsModelLoader
from ts.utils.util import PredictionException

MANIFEST = os.path.join("MAR-INF", "MANIFEST.json")
JSON = "application/json"
# common/decoding.py's DEFAULT_MAX_PIXELS (this file imports no module of ours): the largest image, by its header,
# a request may bring when the model's config names no `max_pixels`.
DEFAULT_MAX_PIXELS = 50_000_000
TOO_LARGE, BAD_REQUEST, PREDICTION_FAILED = 413, 400, 503
logger = logging.getLogger("ts_handler")


class HandlerError(RuntimeError):
    """The archive's handler could not be loaded or initialized; the message names it and the reason."""


class Refused(ValueError):
    """One request refused before the handler sees it: the reason, and the HTTP status the TorchServe front gives."""

    def __init__(self, reason: str, status: int):
        super().__init__(f"{reason} ({status})")
        self.reason, self.status = reason, status


@dataclass(frozen=True)
class Answer:
    """One request's answer: the payload as TorchServe's worker serializes it, or an error: TorchServe's message,
    the HTTP status its frontend answers with, and the reason (for the log: TorchServe's answer names none)."""

    payload: bytes = b""
    content_type: str = ""
    error: str | None = None
    status: int = 200
    reason: str = ""

    def failure(self) -> str:
        """The error in words, its status and reason in them: `Prediction failed (503): ValueError: ...`."""
        return f"{self.error} ({self.status})" + (f": {self.reason}" if self.reason else "")


def load(model_dir: str, model_name: str, gpu: int | None, batch_size: int):
    """TorchServe's Service for the archive unpacked in `model_dir`, made by TorchServe's own loader: the
    manifest's handler (a file with one handler class, a file with handle(data, context), or a built-in name),
    its Context (model_yaml_config from the manifest's configFile), initialize(context) run once."""
    try:
        with open(os.path.join(model_dir, MANIFEST), encoding="utf-8") as file:
            handler = json.load(file)["model"]["handler"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise HandlerError(f"{model_dir}: no handler in {MANIFEST}: {exc}") from None
    # TorchServe's frontend starts each worker in the model's folder with that folder on PYTHONPATH: handlers
    # import their model file by bare name (BaseHandler._load_pickled_model) and open files by relative path.
    # Each instance is its own stub process, so the working directory is this instance's alone.
    sys.path.insert(0, model_dir)
    os.chdir(model_dir)
    _utf8_locale()
    metrics = MetricsCacheYamlImpl(os.path.join(os.path.dirname(ts.__file__), "configs", "metrics.yaml"))
    metrics.initialize_cache()
    metrics.model_name = model_name
    try:
        return TsModelLoader().load(model_name, model_dir, handler, gpu, batch_size, None, True, metrics)
    except Exception as exc:  # the handler's own code: anything may come out of it
        logger.exception("TorchServe handler %s failed to initialize", handler)
        raise HandlerError(f"TorchServe handler {handler!r} failed to initialize: "
                           f"{type(exc).__name__}: {_first_line(exc)}") from None


def _utf8_locale() -> None:
    """UTF-8 as open()'s default where the stub runs in the C locale (no LANG in tritonserver's environment):
    TorchServe's base_handler imports openvino.torch where installed, which imports torch._inductor, which reads
    its UTF-8 templates with the default encoding and fails in ASCII. The stub is this instance's own process."""
    import locale

    encoding = (getattr(locale, "getencoding", None) or (lambda: locale.getpreferredencoding(False)))()
    if encoding.lower().replace("-", "").replace("_", "") not in ("ascii", "ansix3.41968"):
        return
    for name in ("C.UTF-8", "C.utf8", "en_US.UTF-8"):
        try:
            locale.setlocale(locale.LC_CTYPE, name)
            return
        except locale.Error:
            continue


def bound_images(max_pixels: int) -> None:
    """PIL in this stub refuses an image whose header claims over `max_pixels` (a decode the handler does itself:
    PIL only warns between its bound and twice it, so the warning is an error here)."""
    from PIL import Image

    Image.MAX_IMAGE_PIXELS = max_pixels
    warnings.simplefilter("error", Image.DecompressionBombWarning)


def check_image(body: bytes) -> None:
    """Refused (413) where the body is an image whose header claims more pixels than PIL's bound (bound_images):
    PIL reads the header only. Anything that is not an image passes (the handler judges it), as does a corrupt one."""
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(body)) as image:
                pixels = image.width * image.height
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        claimed = re.search(r"\((\d+) pixels\)", str(exc))
        pixels = int(claimed.group(1)) if claimed else None
    except Exception:  # not an image PIL knows, or a corrupt one: the handler's to answer, as under TorchServe
        return
    bound = Image.MAX_IMAGE_PIXELS
    if bound is not None and (pixels is None or pixels > bound):
        size = f"{pixels:,} pixels" if pixels is not None else "its size"
        # common/decoding.py's wording: both fronts refuse a bomb in the same words
        raise Refused(f"decompression bomb refused: the header claims {size}, more than max_pixels {bound:,}",
                      TOO_LARGE)


def request_item(body: bytes, headers: dict[str, str]) -> tuple[dict, dict]:
    """One request as TorchServe's worker hands it to handle(): its body under "data" and "body" (decoded as
    TorchServe decodes by content type: JSON -> object, text/* -> str), and the headers its RequestProcessor
    holds (each input's content type, then the request's own headers). Refused: this request alone is refused
    (an image over the pixel bound, JSON nested deeper than Python's parser goes)."""
    check_image(body)
    content_type = next((value for key, value in headers.items() if key.lower() == "content-type"), "")
    value = body
    if content_type == JSON:
        try:
            value = json.loads(body.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):  # TorchServe forwards the bytes too
            pass
        except RecursionError:  # no ValueError: it failed the whole batch. TorchServe forwards the bytes, which a
            # handler's own json.loads fails on, and with it the batch: refused here, this request alone
            raise Refused("JSON nested too deeply to parse", BAD_REQUEST) from None
    elif content_type.startswith("text"):
        try:
            value = body.decode("utf-8")
        except UnicodeDecodeError:
            pass
    item = {"data": value, "body": value}
    return item, {**{name: {"content-type": content_type} for name in item}, **headers}


def request_entries(body: bytes, layout: str, headers: dict[str, str]) -> tuple[dict, dict]:
    """One request whose named entries (a gRPC input map) lie end to end in `body`, `layout` their names and lengths
    (JSON): each entry under its own name, as bytes (gRPC gives no content type), as TorchServe's worker hands them."""
    item, offset = {}, 0
    for name, length in json.loads(layout):
        item[str(name)] = body[offset:offset + int(length)]
        offset += int(length)
        check_image(item[str(name)])
    return item, {**{name: {"content-type": ""} for name in item}, **headers}


def predict(service, items: list[tuple[dict, dict]]) -> list[Answer]:
    """ONE handle() call for the whole batch, as ts/service.py's Service.predict: a failure of that call or a
    wrong number of answers fails every request of the batch (TorchServe's 503/507 messages, with the reason);
    otherwise each request gets its own answer, serialized as create_predict_response does."""
    context = service.context
    ids = {index: str(uuid.uuid4()) for index in range(len(items))}
    context.request_ids = ids
    context.request_processor = [RequestProcessor(headers) for _, headers in items]
    context.metrics.request_ids = ids
    context.cl_socket = None  # streaming answers (send_intermediate_predict_response) need the Java frontend
    data = [item for item, _ in items]
    start = time.time()
    try:
        # Service.predict would encode the answers for the frontend's socket; its entry point is the handler's
        # handle (torchserve is pinned, so is this attribute).
        answers = service._entry_point(data, context)
    except MemoryError:
        return _fail(len(items), "Out of resources", "out of memory", 507)
    except PredictionException as exc:
        return _fail(len(items), str(exc.message), "", exc.error_code)
    except (Exception, SystemExit) as exc:  # the handler's own code: one batch's failure never ends the stub
        logger.warning("Invoking custom service failed.", exc_info=True)
        reason = f"{type(exc).__name__}: {_first_line(exc)}"
        return _fail(len(items), "Out of resources", reason, 507) if "CUDA" in str(exc) else \
            _fail(len(items), "Prediction failed", reason)
    if not isinstance(answers, list):
        return _fail(len(items), "Invalid model predict output",
                     f"handle() returned {type(answers).__name__}, not a list")
    if len(answers) != len(items):
        return _fail(len(items), "number of batch response mismatched",
                     f"expected {len(items)} answers, got {len(answers)}")
    context.metrics.add_time("PredictionTime", round((time.time() - start) * 1000, 2))
    try:
        return [_answer(context, index, answer) for index, answer in enumerate(answers)]
    except TypeError as exc:
        return _fail(len(items), "Unsupported model output data type.", _first_line(exc))


def serialize(answer) -> tuple[bytes, bool]:
    """An answer's bytes as TorchServe's create_predict_response writes them: bytes as they are, str in UTF-8, a
    tensor by torch.save, anything else json.dumps(indent=2) (TypeError where it cannot); and whether JSON."""
    import torch

    if isinstance(answer, (bytes, bytearray)):
        return bytes(answer), False
    if isinstance(answer, str):
        return answer.encode("utf-8"), False
    if isinstance(answer, torch.Tensor):
        buffer = io.BytesIO()
        torch.save(answer, buffer)
        return buffer.getvalue(), False
    return json.dumps(answer, indent=2).encode("utf-8"), True


def _answer(context, index: int, answer) -> Answer:
    payload, _ = serialize(answer)
    code, phrase = context.get_response_status(index)
    if code is not None and code >= 400:  # the handler failed this request alone (context.set_response_status)
        return Answer(error=phrase or "error", status=code)
    # The type the handler set, or none: TorchServe's frontend sends a handler's answer with no content-type unless
    # its handler set one (RestJob.responseInference), JSON or not.
    return Answer(payload, context.get_response_content_type(index) or "")


def _fail(count: int, message: str, reason: str = "", status=PREDICTION_FAILED) -> list[Answer]:
    """Every request of the batch failed with TorchServe's `message` and `status` (a handler's PredictionException
    may name any: outside 400..599, 503)."""
    status = status if isinstance(status, int) and 400 <= status <= 599 else PREDICTION_FAILED
    return [Answer(error=message, status=status, reason=reason)] * count


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
