"""What the CPU offers, read from /proc/cpuinfo: the backend picks its path by it, build-repo reports it.

build-repo copies this file beside the classifier's model.py, so it must stay self-contained.
"""
from __future__ import annotations


def cpuinfo(field: str) -> str:
    """The first `field` of /proc/cpuinfo ("model name", "flags"); "" where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.split(":")[0].strip() == field), "")
    except OSError:
        return ""


def cpu_bf16() -> bool:
    """True where the CPU computes bf16 natively (AMX-BF16 or AVX512-BF16): elsewhere oneDNN emulates it,
    slower than fp32."""
    flags = cpuinfo("flags").split()
    return "amx_bf16" in flags or "avx512_bf16" in flags


def cpu_int8_dot() -> bool:
    """True where the CPU has an int8 dot product that does not saturate (VNNI's vpdpbusd, AVX-512 or AVX, or AMX):
    without one, x86 multiplies unsigned by signed bytes with vpmaddubsw, whose pairwise sums saturate at 16 bits."""
    flags = cpuinfo("flags").split()
    return any(flag in flags for flag in ("avx512_vnni", "avx_vnni", "amx_int8"))
