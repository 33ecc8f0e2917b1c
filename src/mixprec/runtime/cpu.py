"""What this CPU can compute fast: bf16, fp16, INT8 dot products (VNNI), AMX tiles.

Read once from ``/proc/cpuinfo`` (Linux; elsewhere every flag reads as absent and the
features say so). Which runtime uses which feature is the engines' business
(:mod:`mixprec.runtime.engine`); this module only reads the flags.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass

__all__ = ["CpuFeatures", "cpu_features", "parse_cpuinfo", "saturates_u8s8"]

_CPUINFO = "/proc/cpuinfo"


@dataclass(frozen=True)
class CpuFeatures:
    """The compute features of this CPU that decide low-precision speed.

    Attributes:
        model: The CPU's model name (or the platform's machine name).
        flags: Every feature flag the kernel reports.
    """

    model: str
    flags: frozenset[str]

    @property
    def bf16(self) -> bool:
        """bfloat16 arithmetic in hardware: AVX-512 BF16 (Cooper Lake, Zen 4) or AMX-BF16."""
        return bool({"avx512_bf16", "amx_bf16"} & self.flags)

    @property
    def amx(self) -> bool:
        """AMX tile matrix units (Sapphire Rapids and later)."""
        return "amx_tile" in self.flags

    @property
    def vnni(self) -> bool:
        """INT8 dot-product instructions (AVX-512 VNNI or AVX-VNNI)."""
        return bool({"avx512_vnni", "avx_vnni"} & self.flags)

    @property
    def fp16(self) -> bool:
        """float16 arithmetic in hardware (AVX-512 FP16 or AMX-FP16)."""
        return bool({"avx512_fp16", "amx_fp16"} & self.flags)

    @property
    def avx512(self) -> bool:
        return "avx512f" in self.flags

    @property
    def avx2(self) -> bool:
        return "avx2" in self.flags

    def summary(self) -> dict[str, bool]:
        """The features by name, as reports and ``--json`` give them."""
        return {
            "bf16": self.bf16,
            "fp16": self.fp16,
            "int8_vnni": self.vnni,
            "amx": self.amx,
            "avx512": self.avx512,
            "avx2": self.avx2,
        }

    def describe(self) -> str:
        """One line: ``Intel(R) Xeon(R): bf16 (AMX), fp16, INT8 VNNI, AVX-512``."""
        parts = []
        if self.bf16:
            via = "AMX" if "amx_bf16" in self.flags else "avx512_bf16"
            parts.append(f"bf16 ({via})")
        if self.fp16:
            parts.append("fp16")
        if self.vnni:
            parts.append("INT8 VNNI")
        if self.avx512:
            parts.append("AVX-512")
        elif self.avx2:
            parts.append("AVX2")
        found = ", ".join(parts) or "no bf16, fp16 or INT8 dot-product instructions"
        return f"{self.model}: {found}"


def parse_cpuinfo(text: str) -> CpuFeatures:
    """The features of the first processor listed in ``/proc/cpuinfo`` text."""
    model = ""
    flags: frozenset[str] = frozenset()
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
    return CpuFeatures(model or platform.machine() or "unknown CPU", flags)


@functools.cache
def cpu_features() -> CpuFeatures:
    """This machine's CPU features (read once)."""
    try:
        with open(_CPUINFO, encoding="utf-8", errors="replace") as f:
            return parse_cpuinfo(f.read())
    except OSError:
        return CpuFeatures(platform.processor() or platform.machine() or "unknown CPU", frozenset())


def saturates_u8s8(cpu: CpuFeatures | None = None) -> bool:
    """Whether this x86 CPU (or ``cpu``) multiplies u8 x s8 with AVX2's ``vpmaddubsw``,
    which sums pairs of products in 16 bits and saturates (no VNNI): what 7-bit INT8
    weights avoid. False off x86, or where the flags cannot be read."""
    cpu = cpu or cpu_features()
    machine = platform.machine().lower()
    return machine in ("x86_64", "amd64") and bool(cpu.flags) and not cpu.vnni
