"""The Triton names of a TorchServe registration: BASE (the model name, else NAME_vVERSION, else with a hash) plus
what build-repo adds to it, never another registration's."""
from __future__ import annotations

import hashlib
import re

from common import names

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
# A registration's Triton names: BASE and what build-repo may add to it (common/names.py's table, the exports of
# --formats and BASE_explain, the image path's explanations, included); no two registrations may share one.
SUFFIXES = tuple(names.SUFFIXES.values())
# The longest model name and version: BASE (the name, or NAME_vVERSION cut at 160) + a 33-character hash + the longest
# suffix stays far within a file name's 255 bytes, and a snapshot of many registrations stays small (issue 52 F3).
MAX_NAME, MAX_VERSION = 128, 64


def refusal(name: str, version: str) -> str | None:
    """Why (name, version) cannot be registered (the message names the model, cut short), or None."""
    shown = name if len(name) <= 80 else f"{name[:80]}... ({len(name)} characters)"
    if not NAME.match(name):
        return f"Invalid model name: {shown}: letters, digits, '_', '.' and '-' only"
    if len(name) > MAX_NAME:
        return f"Invalid model name: {shown}: at most {MAX_NAME} characters"
    if len(version) > MAX_VERSION:
        return f"Invalid model version of model {shown}: at most {MAX_VERSION} characters"
    return None


def triton_names(base: str) -> set[str]:
    return names.every_name(base)


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
