"""The native kernels' instruction-set variants: what each is built with and what it needs.

Owns: the registry of variants, best first. Each variant compiles the same sources
(build.SOURCES: kquant.cpp, quantize.cpp, layers.cpp, decoder.cpp, topk.cpp) with its own
compiler flags into its own library and op namespace (`torch.ops.<namespace>`), so a process
may load several side by side; the row kernels of kquant.cpp pick their instruction set from
the compiler's macros (kquant_avx512.h under AVX-512 VNNI, kquant_avx2.h otherwise).

A variant is a candidate on a machine whose CPU reports every flag in `cpu_flags` (Linux's
/proc/cpuinfo names) and whose OS grants `os_feature` where one is named; the probe
(probe.py) then runs its self-test in a child process before the variant is used.

AMX (tile) variants would name the XTILEDATA permission here (arch_prctl
ARCH_REQ_XCOMP_PERM); none is built yet: no machine this project has tested on could run one.

Must not know: how variants are built, probed or chosen.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Variant:
    name: str
    cflags: tuple[str, ...]  # instruction-set flags, beside the common ones (build.py)
    cpu_flags: tuple[str, ...]  # /proc/cpuinfo flags the CPU must report
    os_feature: str | None = None  # an OS permission the probe must obtain (probe.OS_FEATURES)

    @property
    def namespace(self) -> str:
        """The op namespace of its library: `torch.ops.<namespace>`."""
        return f"specav_{self.name}"

    def missing(self, flags: set[str]) -> list[str]:
        return [f for f in self.cpu_flags if f not in flags]


_AVX2 = ("avx2", "fma", "f16c")
VARIANTS: tuple[Variant, ...] = (
    Variant("avx512vnni", ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
                           "-mavx512vnni"),
            _AVX2 + ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni")),
    Variant("avx2", ("-mavx2", "-mfma", "-mf16c"), _AVX2),
)
BY_NAME = {v.name: v for v in VARIANTS}
