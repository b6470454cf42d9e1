"""The Triton models one classifier NAME is served as, and what each is: one table read by the builder, the server,
the clients, perf and the drills (never a suffix spelled out elsewhere)."""
from __future__ import annotations

# role -> what build-repo (or the TorchServe front) appends to NAME for it
SUFFIXES = {
    "classifier": "",  # NAME: the classifier itself (IMAGE in, LOGITS out), or an archive's own handler model
    "preprocess": "_preprocess",  # the image path's decoder, in the ensemble
    "image": "_image",  # the image path's entry: JPEG/PNG bytes in (an ensemble, or one fused model)
    "onnx": "_onnx",  # build-repo --formats onnx
    "torchscript": "_torchscript",  # build-repo --formats torchscript
    "explain": "_explain",  # the TorchServe front's explanations of the image path (its handler model)
}
EXPORTS = ("onnx", "torchscript")


def named(base: str, role: str) -> str:
    """The Triton model of `role` for classifier `base`: named("m", "image") == "m_image"."""
    return base + SUFFIXES[role]


def every_name(base: str) -> set[str]:
    """Every Triton name `base` may be served under (what another registration must not take)."""
    return {base + suffix for suffix in SUFFIXES.values()}


def image_model(base: str) -> str:
    return named(base, "image")


def base_of(model: str) -> str:
    """The classifier's name from its image model's (`m_image` -> `m`), or `model` itself."""
    return model.removesuffix(SUFFIXES["image"])


def build_roles(base: str) -> dict[str, str]:
    """Each model an image-path build may write -> its role as build-repo's JSON says it (common/build_result.ROLES:
    the exports are both "export")."""
    return {named(base, role): "export" if role in EXPORTS else role
            for role in ("classifier", "preprocess", "image", *EXPORTS)}
