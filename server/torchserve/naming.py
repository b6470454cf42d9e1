"""The Triton names of a TorchServe registration: BASE (the model name, else NAME_vVERSION, else with a hash) plus
what build-repo adds to it, never another registration's."""
from __future__ import annotations

import hashlib
import re

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
# What build-repo may add to BASE (the onnx/torchscript exports with --formats), and BASE_explain (the image path's
# explanations, explainers.py): a registration's Triton names are BASE plus each of these, and no two registrations
# may share one.
SUFFIXES = ("", "_preprocess", "_image", "_onnx", "_torchscript", "_explain")


def triton_names(base: str) -> set[str]:
    return {base + suffix for suffix in SUFFIXES}


def triton_base(name: str, version: str, first: bool, taken: set[str]) -> str | None:
    """The Triton name of (name, version): `name` for a name's first version, else NAME_vVERSION with each character
    outside [A-Za-z0-9] as '_'; where one of its names is `taken` (another version or model sanitized alike: "2.0"
    and "2_0", or a model named m_image beside m) a hash of (name, version) is appended. None: even that is taken."""
    readable = name if first else f"{name}_v{re.sub(r'[^A-Za-z0-9]', '_', version)}"[:160]
    digest = hashlib.sha256(f"{name}\0{version}".encode()).hexdigest()
    for base in (readable, f"{readable}_{digest[:8]}", f"{readable}_{digest[:32]}"):
        if not triton_names(base) & taken:
            return base
    return None
