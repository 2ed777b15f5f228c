"""Fused CPU kernels for the fp32 -> bf16 exports (stochastic rounding, error feedback).

A small C file is compiled on first use with the system C compiler (``$CC``, else ``cc``/``gcc``/``clang``,
with OpenMP and ``-march=native``) into a cache folder and called through ``ctypes`` on the tensors' memory:
one pass over the data, the hash RNG computed in registers. It has no Python or torch headers, so it builds
in about a second. If no compiler is available (or ``TRL_FP8_NO_NATIVE=1``), :func:`load` returns None and
callers use the PyTorch implementation, which gives bit-identical results (tested).

The cache folder is ``$TRL_FP8_CACHE``, else ``$XDG_CACHE_HOME/trl_fp8``, else ``~/.cache/trl_fp8``.

- **Cache key.** The library is named ``fair_cast_<sha256 prefix>.so``, hashed over everything that changes
  the binary: the C source, the compiler flags, the compiler (its resolved path, size and mtime, and the
  output of ``cc --version`` and ``cc -dumpmachine``), and the CPU it was built for (``platform.machine()``,
  the OS, the pointer size, the CPU identity and feature-flag lines of ``/proc/cpuinfo`` on Linux, and the
  macros the compiler predefines under ``-march=native``). A library built on another CPU or by another
  compiler therefore has another name and is never loaded.
- **Permissions.** The folder is created with mode 0700. A folder that is not owned by the current user or
  is group- or other-writable is refused, and so is an existing library in it that is not a regular file
  owned by the current user or is group- or other-writable: :func:`load` then returns None with one warning
  naming the path and the reason. A new library is compiled to a temporary name in the same folder, made
  0700, fsync'd and moved into place with ``os.replace``, so no process ever loads half a library. A cached
  library that does not load (truncated, corrupt) is removed and rebuilt once, with a warning.
- **Probe cache.** The compiler's part of the key takes three compiler runs; their result is kept beside the
  libraries in ``probe_<hash>.json``, named by what identifies the toolchain and CPU without running anything
  (the compiler's resolved path, size and mtime, the CPU lines of ``/proc/cpuinfo``), so a later process with the
  library cached runs no compiler at all.
- **Calls.** :func:`sr_bf16` and :func:`ef_bf16` check every tensor (type, dtype, shape, CPU device,
  contiguity) and the scalar arguments before handing raw pointers to the library, and raise a
  ``TypeError``/``ValueError`` naming the argument otherwise.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import platform
import shutil
import stat
import struct
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch

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

/* offset: the global index of src[0] in its tensor (a shard's start), so shards draw the one-process bits */
void trl_fp8_sr_bf16(const uint32_t *src, uint16_t *dst, int64_t n, uint32_t key, int nthreads, int64_t offset) {
    #pragma omp parallel for simd schedule(static) num_threads(nthreads)
    for (int64_t i = 0; i < n; ++i) {
        uint32_t b = src[i];
        uint32_t r = mix32((uint32_t)(i + offset) * 0x9E3779B9U + key) >> 16;
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

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-fno-math-errno")

# /proc/cpuinfo fields that identify the CPU and its instruction-set extensions (x86, Arm, RISC-V, POWER);
# clock speeds, bogomips and the like are left out because they change from run to run.
_CPUINFO_FIELDS = frozenset({
    "vendor_id", "cpu family", "model", "model name", "flags",
    "features", "cpu implementer", "cpu architecture", "cpu variant", "cpu part",
    "isa", "uarch", "mmu", "cpu",
})


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


def _current_uid() -> int:
    return os.geteuid()


def _run_text(cmd: list[str]) -> str:
    """stdout + stderr + exit status of ``cmd``, or the error that stopped it (all go into the cache key)."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as err:
        return f"<{type(err).__name__}: {err}>"
    return f"{proc.stdout}\n{proc.stderr}\nrc={proc.returncode}"


def _compiler_file(cc: str) -> list[str]:
    """The compiler driver's resolved path and its ``size:mtime`` ("?" when it cannot be read)."""
    real = os.path.realpath(cc)
    try:
        st = os.stat(real)
        return [real, f"{st.st_size}:{st.st_mtime_ns}"]
    except OSError:
        return [real, "?"]


def _compiler_identity(cc: str) -> str:
    """The compiler as a string: resolved path, size and mtime of the driver, ``--version``, ``-dumpmachine``."""
    return "\n".join([*_compiler_file(cc), _run_text([cc, "--version"]), _run_text([cc, "-dumpmachine"])])


def _cpuinfo_identity() -> list[str]:
    """The CPU identity and feature-flag lines of ``/proc/cpuinfo`` (or ``platform.processor()``), sorted."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            lines = set()
            for line in fh:
                name, sep, value = line.partition(":")
                if sep and name.strip().lower() in _CPUINFO_FIELDS:
                    lines.add(f"{name.strip().lower()}: {' '.join(value.split())}")
        return sorted(lines)
    except OSError:
        return [platform.processor()]


def _cpu_features(cc: str) -> str:
    """The CPU the library is built for: machine, OS, pointer size, /proc/cpuinfo identity and flags, and the
    macros the compiler predefines for ``-march=native`` (the instruction-set extensions it will use)."""
    parts = [platform.machine(), sys.platform, str(struct.calcsize("P") * 8), *_cpuinfo_identity()]
    march = [flag for flag in FLAGS if flag.startswith(("-march=", "-mcpu=", "-mtune="))]
    parts.append(_run_text([cc, *march, "-E", "-dM", "-x", "c", os.devnull]))
    return "\n".join(parts)


def _cache_key(cc: str) -> dict[str, str]:
    """Everything that changes the compiled library (see the module docstring). Runs the compiler three times."""
    return {
        "source": C_SOURCE,
        "flags": " ".join(FLAGS),
        "compiler": _compiler_identity(cc),
        "cpu": _cpu_features(cc),
    }


def _toolchain_stamp(cc: str) -> str:
    """What identifies the compiler and CPU without running anything: the compiler's resolved path, size and mtime,
    the machine and the CPU lines of ``/proc/cpuinfo``. The probe (:func:`_cache_key`) is cached under it."""
    return "\n".join([*_compiler_file(cc), platform.machine(), sys.platform, *_cpuinfo_identity()])


def _probed_key(cc: str, folder: Path) -> dict[str, str]:
    """:func:`_cache_key`, read from ``probe_<stamp>.json`` in ``folder`` when an earlier process wrote it (same
    compiler file, same CPU), else computed and written there atomically: the compiler runs once per toolchain and
    CPU, not three times in every process. An unreadable, foreign or group-writable probe file is recomputed."""
    stamp = hashlib.sha256(("\n".join([C_SOURCE, " ".join(FLAGS), _toolchain_stamp(cc)])).encode()).hexdigest()
    path = folder / f"probe_{stamp[:24]}.json"
    try:
        if _why_unsafe(path, os.lstat(path), directory=False) is None:
            with open(path, encoding="utf-8") as fh:
                key = json.load(fh)
            if isinstance(key, dict) and set(key) == {"source", "flags", "compiler", "cpu"} and all(
                    isinstance(v, str) for v in key.values()) and key["source"] == C_SOURCE:
                return key
    except (OSError, ValueError):
        pass
    key = _cache_key(cc)
    try:
        fd, tmp = tempfile.mkstemp(prefix=".probe.", suffix=".tmp", dir=folder)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(key, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError:  # a read-only cache still works: the probe just runs again next time
        pass
    return key


def _cache_tag(key: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def _why_unsafe(path: Path, st: os.stat_result, *, directory: bool) -> str | None:
    """Why ``path`` (with stat result ``st``) must not be trusted, or None when it is safe to use."""
    if directory and not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if not directory and not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    uid = _current_uid()
    if st.st_uid != uid:
        return f"is owned by uid {st.st_uid}, not by the current user (uid {uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is group- or other-writable (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _prepare_dir(folder: Path) -> str | None:
    """Create ``folder`` with mode 0700 if it is missing; the reason it cannot be used, or None."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            pass
        else:
            os.chmod(folder, 0o700)  # the umask may have taken bits away; never added any
        return _why_unsafe(folder, os.stat(folder), directory=True)
    except OSError as err:
        return f"cannot be created or read ({err})"


def _build(cc: str, lib_path: Path) -> None:
    """Compile into a temporary name in ``lib_path``'s folder, then ``os.replace`` it into place."""
    folder = lib_path.parent
    fd, src = tempfile.mkstemp(prefix=f".{lib_path.stem}.", suffix=".c", dir=folder)
    with os.fdopen(fd, "w") as fh:
        fh.write(C_SOURCE)
    fd, tmp_lib = tempfile.mkstemp(prefix=f".{lib_path.stem}.", suffix=".so.tmp", dir=folder)
    os.close(fd)
    try:
        subprocess.run([cc, *FLAGS, src, "-o", tmp_lib], check=True, capture_output=True, text=True,
                       timeout=120, stdin=subprocess.DEVNULL)
        os.chmod(tmp_lib, 0o700)  # the linker creates it with the umask's mode (possibly group-writable)
        fd = os.open(tmp_lib, os.O_RDONLY)
        try:
            os.fsync(fd)  # on disk before its name is: a crash never leaves a truncated library under the final name
        finally:
            os.close(fd)
        os.replace(tmp_lib, lib_path)  # atomic: concurrent builders never see half a library
        _fsync_folder(folder)
    finally:
        for leftover in (src, tmp_lib):
            try:
                os.unlink(leftover)
            except FileNotFoundError:
                pass


def _fsync_folder(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _open(lib_path: Path):
    lib = ctypes.CDLL(str(lib_path))
    lib.trl_fp8_sr_bf16.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint32, ctypes.c_int,
                                    ctypes.c_int64]
    lib.trl_fp8_sr_bf16.restype = None
    lib.trl_fp8_ef_bf16.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    lib.trl_fp8_ef_bf16.restype = None
    return lib


def _refuse(what: str, path: Path, reason: str) -> None:
    warnings.warn(f"trl_fp8: not using the fused Fair Cast CPU kernels: the cache {what} {path} {reason}; "
                  "using the PyTorch implementation (same results, slower). Make it owned by you and not "
                  "group/other-writable (chmod 700), or point TRL_FP8_CACHE at another folder.", stacklevel=3)


@functools.lru_cache(maxsize=None)
def load():
    """The compiled kernel library (a ``ctypes.CDLL``), or None when it cannot be built or trusted here."""
    if os.environ.get("TRL_FP8_NO_NATIVE", "") not in ("", "0") or sys.platform == "win32":
        return None
    cc = _compiler()
    if cc is None:
        return None
    folder = _cache_dir()
    reason = _prepare_dir(folder)
    if reason is not None:
        _refuse("folder", folder, reason)
        return None
    lib_path = folder / f"fair_cast_{_cache_tag(_probed_key(cc, folder))}.so"
    for attempt in (1, 2):
        if not os.path.lexists(lib_path):
            try:
                _build(cc, lib_path)
            except (OSError, subprocess.SubprocessError) as err:
                detail = getattr(err, "stderr", "") or str(err)
                warnings.warn(f"trl_fp8: could not build the fused Fair Cast CPU kernels ({detail.strip()[:200]}); "
                              "using the PyTorch implementation (same results, slower).", stacklevel=2)
                return None
        try:
            reason = _why_unsafe(lib_path, os.lstat(lib_path), directory=False)
        except OSError as err:
            reason = f"cannot be read ({err})"
        if reason is not None:
            _refuse("library", lib_path, reason)
            return None
        try:
            return _open(lib_path)
        except (OSError, AttributeError) as err:  # truncated, corrupt, or without our symbols
            if attempt == 2:
                warnings.warn(f"trl_fp8: the freshly built Fair Cast CPU kernels {lib_path} do not load ({err}); "
                              "using the PyTorch implementation (same results, slower).", stacklevel=2)
                return None
            warnings.warn(f"trl_fp8: the cached Fair Cast CPU kernels {lib_path} do not load ({err}); rebuilding "
                          "them once.", stacklevel=2)
            try:
                os.unlink(lib_path)
            except FileNotFoundError:
                pass
            except OSError as unlink_err:
                warnings.warn(f"trl_fp8: cannot remove {lib_path} ({unlink_err}); using the PyTorch "
                              "implementation (same results, slower).", stacklevel=2)
                return None
    return None


def _check_tensor(name: str, t, dtype: torch.dtype, shape: torch.Size | None = None) -> None:
    """Raise unless ``t`` is a contiguous CPU tensor of ``dtype`` (and ``shape``): safe for a raw-pointer call."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {t.dtype}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got device {t.device}")
    if shape is not None and t.shape != shape:
        raise ValueError(f"{name} must have shape {tuple(shape)} (the shape of src), got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_nthreads(nthreads) -> None:
    if isinstance(nthreads, bool) or not isinstance(nthreads, int) or not 1 <= nthreads < 2**31:
        raise ValueError(f"nthreads must be an int in [1, 2**31), got {nthreads!r}")


def sr_bf16(lib, src: torch.Tensor, out: torch.Tensor | None, key: int, nthreads: int, offset: int = 0) -> torch.Tensor:
    """Stochastically round fp32 ``src`` into bf16 ``out`` (allocated when None) with the kernel in ``lib``.

    ``src``: contiguous fp32 CPU tensor; ``out``: contiguous bf16 CPU tensor of ``src``'s shape; ``key``: the
    32-bit stream key; ``nthreads`` >= 1; ``offset`` >= 0: the index of ``src[0]`` in the whole tensor (a shard's
    start). Anything else raises before the library sees a pointer.
    """
    _check_tensor("src", src, torch.float32)
    if out is None:
        out = torch.empty(src.shape, dtype=torch.bfloat16)
    _check_tensor("out", out, torch.bfloat16, src.shape)
    if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key < 2**32:
        raise ValueError(f"key must be an int in [0, 2**32), got {key!r}")
    _check_nthreads(nthreads)
    if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset < 2**62:
        raise ValueError(f"offset must be an int in [0, 2**62), got {offset!r}")
    lib.trl_fp8_sr_bf16(src.data_ptr(), out.data_ptr(), src.numel(), key, nthreads, offset)
    return out


def ef_bf16(lib, src: torch.Tensor, residual: torch.Tensor, out: torch.Tensor | None, nthreads: int) -> torch.Tensor:
    """Error-feedback round fp32 ``src`` into bf16 ``out`` (allocated when None), updating ``residual`` in place.

    ``src`` and ``residual``: contiguous fp32 CPU tensors of one shape; ``out``: contiguous bf16 CPU tensor of
    that shape; ``nthreads`` >= 1. Anything else raises before the library sees a pointer.
    """
    _check_tensor("src", src, torch.float32)
    _check_tensor("residual", residual, torch.float32, src.shape)
    if out is None:
        out = torch.empty(src.shape, dtype=torch.bfloat16)
    _check_tensor("out", out, torch.bfloat16, src.shape)
    _check_nthreads(nthreads)
    lib.trl_fp8_ef_bf16(src.data_ptr(), residual.data_ptr(), out.data_ptr(), src.numel(), nthreads)
    return out
