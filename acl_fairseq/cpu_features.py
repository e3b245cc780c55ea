"""The CPU's instruction-set flags and model name, read once from Linux's ``/proc/cpuinfo``.

bf16 training and int8 inference depend on them. Unreadable (another OS): all False, the
safe choice.
"""

from __future__ import annotations

import functools
from pathlib import Path

__all__ = ["cpu_flags", "cpu_model_name", "has_native_bf16", "has_vnni"]

CPUINFO = Path("/proc/cpuinfo")


@functools.cache
def _cpuinfo() -> str:
    try:
        return CPUINFO.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The ``flags`` of ``cpuinfo`` (default: this machine's ``/proc/cpuinfo``)."""
    flags: set[str] = set()
    for line in (_cpuinfo() if cpuinfo is None else cpuinfo).splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            flags.update(value.split())
    return frozenset(flags)


def cpu_model_name(cpuinfo: str | None = None) -> str | None:
    """The ``model name`` line of ``cpuinfo`` (default: this machine's), if any."""
    for line in (_cpuinfo() if cpuinfo is None else cpuinfo).splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            return value.strip()
    return None


def has_native_bf16(cpuinfo: str | None = None) -> bool:
    """bfloat16 instructions (AVX512-BF16 or AMX): bf16 there is faster than fp32; without
    them it is emulated, and slower."""
    return bool(cpu_flags(cpuinfo) & {"avx512_bf16", "amx_bf16"})


def has_vnni(cpuinfo: str | None = None) -> bool:
    """8-bit dot-product instructions (AVX512-VNNI, AVX-VNNI or AMX): int8 products accumulate
    in 32 bits, so activations can use all 8 bits."""
    return bool(cpu_flags(cpuinfo) & {"avx512_vnni", "avx_vnni", "amx_int8"})
