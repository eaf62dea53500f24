"""Another CPU's kernels on this one: `python tests/cpu_kernels.py PROFILE -- CMD...` runs CMD with torch, MKL,
oneDNN and numpy held to PROFILE's instruction set, so `make test` proves the numerics tests are not tuned to
this CPU's. The conftest checks in that run that each library did switch, and stops the run if one did not."""

from __future__ import annotations

import os
import sys

PROFILE_ENV = "POOLBENCH_CPU_PROFILE"

# Per profile: the environment that selects the kernels, and what torch and numpy report once they obey it.
# ATEN_CPU_CAPABILITY picks torch's own kernels, MKL_ENABLE_INSTRUCTIONS and ONEDNN_MAX_CPU_ISA the BLAS and
# oneDNN ones torch calls, NPY_DISABLE_CPU_FEATURES numpy's SIMD loops (its baseline, X86_V2, stays).
PROFILES: dict[str, dict[str, str]] = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2",
             "NPY_DISABLE_CPU_FEATURES": "X86_V4 AVX512_ICL AVX512_SPR"},
    "default": {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "ONEDNN_MAX_CPU_ISA": "SSE41",
                "NPY_DISABLE_CPU_FEATURES": "X86_V3 X86_V4 AVX512_ICL AVX512_SPR"},
}
TORCH_CAPABILITY = {"avx2": "AVX2", "default": "DEFAULT"}
NUMPY_DISPATCH = {"avx2": {"X86_V3"}, "default": set()}  # the SIMD extensions numpy may still dispatch to


def profile_mismatches(profile: str) -> list[str]:
    """What in this process does not run PROFILE's kernels (empty when all switched)."""
    import torch

    wrong = []
    torch_has = torch.backends.cpu.get_cpu_capability()
    if torch_has != TORCH_CAPABILITY[profile]:
        wrong.append(f"torch runs {torch_has} kernels, not {TORCH_CAPABILITY[profile]}")
    numpy_has = set(numpy_dispatch())
    if not numpy_has <= NUMPY_DISPATCH[profile]:
        wrong.append(f"numpy dispatches to {sorted(numpy_has)}, beyond {sorted(NUMPY_DISPATCH[profile])}")
    return wrong


def numpy_dispatch() -> list[str]:
    """The SIMD targets above its baseline that numpy found and will dispatch to (as np.show_runtime reports:
    NPY_DISABLE_CPU_FEATURES clears a target's flag at import)."""
    from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__

    return [target for target in __cpu_dispatch__ if __cpu_features__[target]]


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[0] not in PROFILES or argv[1] != "--":
        print(f"usage: cpu_kernels.py {{{','.join(PROFILES)}}} -- CMD...", file=sys.stderr)
        return 2
    env = {**os.environ, **PROFILES[argv[0]], PROFILE_ENV: argv[0]}
    os.execvpe(argv[2], argv[2:], env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
