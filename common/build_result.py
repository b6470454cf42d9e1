"""build-repo's result as one JSON object (`build-repo --json`): the models it wrote, each with its role, or why not;
the TorchServe front reads it instead of build-repo's words or the folders it left."""
from __future__ import annotations

import json
from dataclasses import dataclass

# What a written model is: NAME (the classifier), NAME_preprocess (the image path's decoder), NAME_image (the image
# path's entry: an ensemble or one fused model), NAME_onnx / NAME_torchscript (--formats), or NAME served by a
# TorchServe archive's own handler (--from-mar of a custom handler's archive: BODY in, contract.HANDLER_OUTPUTS out).
ROLES = ("classifier", "preprocess", "image", "export", "handler")


@dataclass(frozen=True)
class BuiltModel:
    name: str
    role: str  # one of ROLES


@dataclass(frozen=True)
class BuildResult:
    repository: str = ""
    models: tuple[BuiltModel, ...] = ()
    error: str | None = None  # why nothing was written (build-repo's one line)
    status: int = 0  # build-repo's exit status

    def __post_init__(self):
        for model in self.models:
            if model.role not in ROLES:
                raise ValueError(f"`role` must be one of {', '.join(ROLES)}, got {model.role!r} ({model.name})")

    @property
    def handler(self) -> bool:
        """Served by the archive's own handler, not by the image path."""
        return any(model.role == "handler" for model in self.models)

    def entry(self) -> str | None:
        """The model a request goes to: the handler model, else the image model (None: neither was written)."""
        return next((m.name for m in self.models if m.role == ("handler" if self.handler else "image")), None)

    def load_order(self) -> list[str]:
        """Every model written, the image model (an ensemble of the others) last."""
        return sorted((m.name for m in self.models), key=lambda name: (name == self.entry(), name))

    def to_json(self) -> str:
        body = {"repository": self.repository, "models": [{"name": m.name, "role": m.role} for m in self.models]}
        if self.error is not None:
            body = {"error": self.error, "status": self.status}
        return json.dumps(body)

    @classmethod
    def from_json(cls, text: str) -> BuildResult:
        """Parsed back; ValueError naming the fault where `text` is not one."""
        try:
            data = json.loads(text)
            if "error" in data:
                return cls(error=str(data["error"]), status=int(data.get("status") or 1))
            return cls(str(data["repository"]), tuple(BuiltModel(str(m["name"]), str(m["role"]))
                                                      for m in data["models"]))
        except (TypeError, KeyError, AttributeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not build-repo's JSON result: {type(exc).__name__}: {exc}") from None
