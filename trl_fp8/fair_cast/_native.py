"""Fused CPU kernels for the fp32 -> bf16 exports (stochastic rounding, error feedback).

A small C file is compiled on first use with the system C compiler (``cc``/``gcc``, OpenMP) into a cache
folder and called through ``ctypes`` on the tensors' memory: one pass over the data, the hash RNG computed in
registers. It has no Python or torch headers, so it builds in about a second. If no compiler is available
(or ``TRL_FP8_NO_NATIVE=1``), :func:`load` returns None and callers use the PyTorch implementation, which
gives bit-identical results (tested).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

C_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>

static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16; x *= 0x7FEB352DU; x ^= x >> 15; x *= 0x846CA68BU; x ^= x >> 16;
    return x;
}

/* Round-to-nearest-even fp32 bits -> bf16 bits, for finite inputs whose result is finite. */
static inline uint16_t rne_bf16(uint32_t b) {
    return (uint16_t)((b + 0x7FFFU + ((b >> 16) & 1U)) >> 16);
}

void trl_fp8_sr_bf16(const uint32_t *src, uint16_t *dst, int64_t n, uint32_t key, int nthreads) {
    #pragma omp parallel for simd schedule(static) num_threads(nthreads)
    for (int64_t i = 0; i < n; ++i) {
        uint32_t b = src[i];
        uint32_t r = mix32((uint32_t)i * 0x9E3779B9U + key) >> 16;
        uint32_t s = b + r;
        uint16_t out = (uint16_t)(s >> 16);
        if ((b & 0x7F800000U) == 0x7F800000U) {
            out = (b & 0x007FFFFFU) ? (uint16_t)0x7FC0U : (uint16_t)(b >> 16);   /* NaN -> canonical NaN, inf kept */
        } else if ((s & 0x7F800000U) == 0x7F800000U) {
            out = (uint16_t)(((b >> 16) & 0x8000U) | 0x7F7FU);                   /* saturate at +-max finite */
        }
        dst[i] = out;
    }
}

void trl_fp8_ef_bf16(const float *src, float *res, uint16_t *dst, int64_t n, int nthreads) {
    const float big = 3.38953138925153547590470800371487866880e+38f; /* largest finite bf16 */
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t i = 0; i < n; ++i) {
        float w = src[i];
        uint32_t b, q32;
        if (!isfinite(w)) {
            memcpy(&b, &w, 4);
            dst[i] = (b & 0x007FFFFFU) ? (uint16_t)0x7FC0U : (uint16_t)(b >> 16);
            res[i] = 0.0f;
            continue;
        }
        float v = w + res[i];
        v = v > big ? big : (v < -big ? -big : v);
        memcpy(&b, &v, 4);
        uint16_t q = rne_bf16(b);
        q32 = ((uint32_t)q) << 16;
        float qf;
        memcpy(&qf, &q32, 4);
        res[i] = v - qf;
        dst[i] = q;
    }
}
"""


def _cache_dir() -> Path:
    root = os.environ.get("TRL_FP8_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "trl_fp8"
    )
    return Path(root)


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


@functools.lru_cache(maxsize=None)
def load():
    """The compiled kernel library (a ``ctypes.CDLL``), or None when it cannot be built here."""
    if os.environ.get("TRL_FP8_NO_NATIVE", "") not in ("", "0") or sys.platform == "win32":
        return None
    cc = _compiler()
    if cc is None:
        return None
    flags = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-fno-math-errno"]
    tag = hashlib.sha256((C_SOURCE + " ".join(flags) + platform.machine() + cc).encode()).hexdigest()[:16]
    lib_path = _cache_dir() / f"fair_cast_{tag}.so"
    if not lib_path.is_file():
        try:
            lib_path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=lib_path.parent) as tmp:
                src = Path(tmp) / "fair_cast.c"
                src.write_text(C_SOURCE)
                tmp_lib = Path(tmp) / lib_path.name
                subprocess.run([cc, *flags, str(src), "-o", str(tmp_lib)], check=True, capture_output=True,
                               text=True, timeout=120)
                os.replace(tmp_lib, lib_path)  # atomic: concurrent builders never see half a library
        except (OSError, subprocess.SubprocessError) as err:
            detail = getattr(err, "stderr", "") or str(err)
            warnings.warn(f"trl_fp8: could not build the fused Fair Cast CPU kernels ({detail.strip()[:200]}); "
                          "using the PyTorch implementation (same results, slower).", stacklevel=2)
            return None
    try:
        lib = ctypes.CDLL(str(lib_path))
    except OSError:
        return None
    lib.trl_fp8_sr_bf16.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint32, ctypes.c_int]
    lib.trl_fp8_sr_bf16.restype = None
    lib.trl_fp8_ef_bf16.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    lib.trl_fp8_ef_bf16.restype = None
    return lib
