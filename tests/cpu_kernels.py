"""Another CPU's kernels on this one: `python tests/cpu_kernels.py PROFILE -- CMD...` runs CMD with torch, MKL,
oneDNN and numpy held to PROFILE's instruction set, so `make test` proves the numerics tests are not tuned to
this CPU's. The conftest checks in that run that each library did switch, and stops the run if one did not.
The `chunked` profile keeps this CPU's kernels and changes what else may change a sum's order on another machine:
one thread, forwards cut into small chunks, and GEMMs that block by row count (tests/reblocked.py)."""

from __future__ import annotations

import os
import sys

PROFILE_ENV = "POOLBENCH_CPU_PROFILE"

# Per profile: the environment that selects torch's, MKL's and oneDNN's kernels, and what torch reports once it
# obeys. numpy's SIMD loops are held by NPY_DISABLE_CPU_FEATURES, built per run from numpy's own dispatch list:
# numpy 2.3 names each extension (AVX2, AVX512_SKX, ...), numpy 2.4 names x86-64 levels (X86_V3, X86_V4, ...).
# numpy's and scipy's OpenBLAS (scipy's LAPACK makes the batched solver's CPU factors) by OPENBLAS_CORETYPE.
PROFILES: dict[str, dict[str, str]] = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2",
             "OPENBLAS_CORETYPE": "Haswell"},
    "default": {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "ONEDNN_MAX_CPU_ISA": "SSE41",
                "OPENBLAS_CORETYPE": "Nehalem"},
    "chunked": {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "POOLBENCH_TEST_MAX_BATCH_TOKENS": "24"},
}
REBLOCKED = {"chunked"}  # profiles that install tests/reblocked.py (the conftest does, before anything runs)
TORCH_CAPABILITY = {"avx2": "AVX2", "default": "DEFAULT"}
_SSE4 = {"SSSE3", "SSE41", "POPCNT", "SSE42", "X86_V2"}
NUMPY_DISPATCH: dict[str, set[str] | None] = {  # the SIMD targets numpy may still dispatch to, in either naming
    "avx2": _SSE4 | {"AVX", "F16C", "FMA3", "AVX2", "X86_V3"},
    "default": _SSE4,
    "chunked": None,  # all of this CPU's
}


def numpy_disabled(profile: str) -> str:
    """NPY_DISABLE_CPU_FEATURES for PROFILE: every target numpy was built to dispatch to beyond the profile's (a
    target this CPU lacks is accepted and stays off)."""
    from numpy._core._multiarray_umath import __cpu_dispatch__

    allowed = NUMPY_DISPATCH[profile]
    return "" if allowed is None else " ".join(target for target in __cpu_dispatch__ if target not in allowed)


def profile_mismatches(profile: str) -> list[str]:
    """What in this process does not run PROFILE's kernels (empty when all switched)."""
    import torch

    wrong = []
    torch_has, torch_wants = torch.backends.cpu.get_cpu_capability(), TORCH_CAPABILITY.get(profile)
    if torch_wants is not None and torch_has != torch_wants:
        wrong.append(f"torch runs {torch_has} kernels, not {torch_wants}")
    numpy_has, numpy_allowed = set(numpy_dispatch()), NUMPY_DISPATCH[profile]
    if numpy_allowed is not None and not numpy_has <= numpy_allowed:
        wrong.append(f"numpy dispatches to {sorted(numpy_has)}, beyond {sorted(numpy_allowed)}")
    wrong.extend(openblas_mismatches(PROFILES[profile].get("OPENBLAS_CORETYPE")))
    if profile in REBLOCKED:
        from reblocked import reblocking_mismatches

        wrong.extend(reblocking_mismatches())
    return wrong


def openblas_mismatches(coretype: str | None) -> list[str]:
    """Each OpenBLAS loaded (numpy's, scipy's) that does not run `coretype`'s kernels (none asked: nothing)."""
    if coretype is None:
        return []
    import scipy.linalg  # noqa: F401  (loads scipy's OpenBLAS beside numpy's)
    from threadpoolctl import threadpool_info

    return [f"{lib['filepath']} runs {lib['architecture']} kernels, not {coretype}" for lib in threadpool_info()
            if lib["internal_api"] == "openblas" and lib["architecture"] != coretype]


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
    disabled = numpy_disabled(argv[0])
    if disabled:
        env["NPY_DISABLE_CPU_FEATURES"] = disabled
    os.execvpe(argv[2], argv[2:], env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
