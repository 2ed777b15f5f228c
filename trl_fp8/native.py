"""Fused CPU kernels: Fair Cast's fp32 -> bf16 exports (stochastic rounding, error feedback), and the weight-sync
checks' bitwise comparisons and token statistics. A neutral module: both import it; it imports neither.

A small C file (:mod:`~trl_fp8.native_source`) is compiled on first use with a C compiler: ``$CC``
when set (a program name looked up through ``PATH``, or a path; one that names nothing gives one warning and the
PyTorch path, never another compiler), else the first of ``cc``/``gcc``/``clang`` found through ``PATH`` — with
OpenMP and ``-march=native``, into a cache folder — and called through ``ctypes`` on the tensors' memory: one pass over the data, the hash RNG computed in registers. It has no Python or torch headers, so it builds
in about a second. If no compiler is available (or ``TRL_FP8_NO_NATIVE=1``), :func:`load` returns None and
callers use the PyTorch implementation, which gives bit-identical results (tested).

The cache folder is ``$TRL_FP8_CACHE``, else ``$XDG_CACHE_HOME/trl_fp8``, else ``~/.cache/trl_fp8``.

- **Cache key.** The library is named ``trl_fp8_<sha256 prefix>.so``, hashed over everything that changes
  the binary: the C source, the compiler flags, the compiler (its resolved path, size and mtime, and the
  output of ``cc --version`` and ``cc -dumpmachine``), and the CPU it was built for (``platform.machine()``,
  the OS, the pointer size, the CPU identity and feature-flag lines of ``/proc/cpuinfo`` on Linux, and the
  macros the compiler predefines under ``-march=native``). A library built on another CPU or by another
  compiler therefore has another name and is never loaded.
- **Permissions.** The folder is created with mode 0700. A folder that is a symbolic link, is not owned by the
  current user or is group- or other-writable is refused; it is opened with ``O_NOFOLLOW`` and checked on the open
  descriptor, and every file in it is then reached through that descriptor (``openat``, or ``/proc/<pid>/fd/N`` for
  the compiler), so renaming the folder or a parent after the check, or planting a link in its place, changes
  nothing. The library is opened the same way (``O_NOFOLLOW``, non-blocking, so a link or a FIFO is refused), the
  *open file* is checked (a regular file owned by the current user, not group- or other-writable), and that very
  file is loaded, through ``/proc/self/fd/N`` (kept open for the life of the process: the loader knows a library
  by that name); where the OS has no ``/proc``, by its name after checking the name still is the open file. A
  refusal makes :func:`load` return None with one warning naming the path and the reason. A new library is
  compiled to a temporary name in the same folder, made 0700, fsync'd and moved into place with ``os.replace``, so
  no process ever loads half a library. A cached library that does not load (truncated, corrupt) is removed and
  rebuilt once, with a warning.
- **Instruction sets.** ``load(isa)`` / ``$TRL_FP8_NATIVE_ISA``: ``native`` (default, ``-march=native``) or
  ``avx2`` (x86-64: ``-march=native -mno-avx512f``, the build an AVX2-only CPU gets, so an AVX-512 machine can test
  and time it); the flags are part of the cache key. The SR kernel is written for 32-bit vector lanes (a 32-bit
  counter carried by addition in blocks of 4096, the special values handled in a second pass over a block only
  when it holds one), which is what makes it as fast with AVX2 as with AVX-512 (``benchmarks/fair_cast_export.py``).
- **Probe cache.** The compiler's part of the key takes three compiler runs; their result is kept beside the
  libraries in ``probe_<hash>.json``, named by what identifies the toolchain and CPU without running anything
  (the compiler's resolved path, size and mtime, the CPU lines of ``/proc/cpuinfo``), so a later process with the
  library cached runs no compiler at all.
- **Comparison.** :func:`first_unequal` compares many CPU tensor pairs bit for bit in one call (the weight-sync
  checks' ``freshness`` and ``quant_parity``): bytes against bytes, or fp32 against bf16 widened, with no copy.
  The same library holds the logprob check's token statistics (one pass over a batch), called from
  :mod:`trl_fp8.sync_checks.tokenstats`, which hands it only contiguous CPU tensors of one shape.
- **Calls.** :func:`sr_bf16`, :func:`ef_bf16` and :func:`first_unequal` (through :func:`comparable_pair`) check
  every tensor (type, dtype, shape, CPU device, contiguity) and the scalar arguments before handing raw pointers to
  the library, and raise a ``TypeError``/``ValueError`` naming the argument otherwise.
"""

from __future__ import annotations

import ctypes
import errno
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

from .native_source import C_SOURCE

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-fno-math-errno")

# The instruction sets the kernel may be built for: ``native`` (everything the CPU has, the default) or ``avx2``
# (x86-64 only: ``-march=native -mno-avx512f``, what the same code gets on a CPU without AVX-512, so an AVX-512 machine
# can measure and test the AVX2 build). Chosen by ``load(isa)``, else ``$TRL_FP8_NATIVE_ISA``, else ``native``.
ISAS = {"native": (), "avx2": ("-mno-avx512f",)}
ISA_ENV = "TRL_FP8_NATIVE_ISA"

# /proc/cpuinfo fields that identify the CPU and its instruction-set extensions (x86, Arm, RISC-V, POWER);
# clock speeds, bogomips and the like are left out because they change from run to run.
_CPUINFO_FIELDS = frozenset({
    "vendor_id", "cpu family", "model", "model name", "flags",
    "features", "cpu implementer", "cpu architecture", "cpu variant", "cpu part",
    "isa", "uarch", "mmu", "cpu",
})
# /proc/cpuinfo flags that name vector (SIMD) extensions, for :func:`vector_extensions`
_VECTOR_PREFIXES = ("sse", "ssse", "avx", "fma", "f16c", "amx", "asimd", "sve", "neon", "vsx", "altivec")


def _cache_dir() -> Path:
    from .models import cache_root  # one rule for the models and the kernels

    return cache_root()


def resolve_isa(isa: str | None = None) -> str:
    """``isa`` (or ``$TRL_FP8_NATIVE_ISA`` when None, default ``native``), checked against :data:`ISAS`."""
    source = "isa"
    if isa is None:
        isa, source = os.environ.get(ISA_ENV, "") or "native", ISA_ENV
    if isa not in ISAS:
        raise ValueError(f"{source} must be one of {', '.join(ISAS)}; got {isa!r}")
    if isa == "avx2" and platform.machine().lower() not in ("x86_64", "amd64"):
        raise ValueError(f"{source}='avx2' builds the kernel for x86-64 without AVX-512; this machine is "
                         f"{platform.machine()}: use 'native'")
    return isa


def _flags(isa: str) -> tuple[str, ...]:
    return FLAGS + ISAS[isa]


def vector_extensions() -> list[str]:
    """The CPU's vector (SIMD) extensions as ``/proc/cpuinfo`` names them (``avx2``, ``avx512f``, ``asimd``, ...),
    sorted; empty where ``/proc/cpuinfo`` has no flag line."""
    found = set()
    for line in _cpuinfo_identity():
        name, _, value = line.partition(": ")
        if name in ("flags", "features"):
            found.update(f for f in value.split() if f.startswith(_VECTOR_PREFIXES))
    return sorted(found)


_CC_WARNED: set[str] = set()  # the $CC values already warned about (one warning each per process)


def _compiler() -> str | None:
    """The C compiler's path: ``$CC`` when it is set — a program name looked up through ``PATH``, or a path — and
    then only that one (a ``$CC`` that names no program gives None: no silent switch to another compiler); else the
    first of ``cc``, ``gcc``, ``clang`` found through ``PATH``."""
    wanted = os.environ.get("CC", "").strip()
    if wanted:
        return shutil.which(wanted)
    for name in ("cc", "gcc", "clang"):
        if shutil.which(name):
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


def _cpu_features(cc: str, isa: str = "native") -> str:
    """The CPU the library is built for: machine, OS, pointer size, /proc/cpuinfo identity and flags, and the
    macros the compiler predefines for ``-march=native`` and the ISA's flags (the extensions it will use)."""
    parts = [platform.machine(), sys.platform, str(struct.calcsize("P") * 8), *_cpuinfo_identity()]
    march = [flag for flag in _flags(isa) if flag.startswith(("-march=", "-mcpu=", "-mtune=", "-mno-"))]
    parts.append(_run_text([cc, *march, "-E", "-dM", "-x", "c", os.devnull]))
    return "\n".join(parts)


def _cache_key(cc: str, isa: str = "native") -> dict[str, str]:
    """Everything that changes the compiled library (see the module docstring). Runs the compiler three times."""
    return {
        "source": C_SOURCE,
        "flags": " ".join(_flags(isa)),
        "compiler": _compiler_identity(cc),
        "cpu": _cpu_features(cc, isa),
    }


def _toolchain_stamp(cc: str) -> str:
    """What identifies the compiler and CPU without running anything: the compiler's resolved path, size and mtime,
    the machine and the CPU lines of ``/proc/cpuinfo``. The probe (:func:`_cache_key`) is cached under it."""
    return "\n".join([*_compiler_file(cc), platform.machine(), sys.platform, *_cpuinfo_identity()])


class _Folder:
    """The cache folder, held open: ``fd`` (opened with ``O_NOFOLLOW`` and checked with ``fstat``), ``path`` (its
    name, for messages) and ``anchor`` (a path that reaches the folder *through the open descriptor*,
    ``/proc/<pid>/fd/N`` (the pid, not ``self``: the compiler, a child process, reaches it too), where the OS has
    one; else ``path``). Every file in it is reached through ``fd`` or
    ``anchor``, so renaming the folder or a parent, or planting a link in its place, after the check changes nothing."""

    def __init__(self, path: Path, fd: int):
        self.path, self.fd = path, fd
        proc = Path(f"/proc/{os.getpid()}/fd/{fd}")
        self.anchor = proc if _same_file(proc, fd) else path

    def close(self) -> None:
        os.close(self.fd)


def _same_file(path: Path, fd: int) -> bool:
    try:
        a, b = os.stat(path), os.fstat(fd)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _open_checked(folder: _Folder, name: str) -> tuple[int | None, str | None]:
    """(fd, None) for ``name`` in ``folder`` opened without following a link and checked on the open file (a
    regular file, owned by the current user, not group/other-writable), else (None, why). ``FileNotFoundError``
    when it is missing."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)  # a FIFO must not block
    try:
        fd = os.open(name, flags, dir_fd=folder.fd)
    except FileNotFoundError:
        raise
    except OSError as err:
        if err.errno == errno.ELOOP:
            return None, "is a symbolic link (not followed)"
        return None, f"cannot be opened ({err})"
    reason = _why_unsafe(folder.path / name, os.fstat(fd), directory=False)
    if reason is not None:
        os.close(fd)
        return None, reason
    return fd, None


def _probed_key(cc: str, folder: _Folder, isa: str = "native") -> dict[str, str]:
    """:func:`_cache_key`, read from ``probe_<stamp>.json`` in ``folder`` when an earlier process wrote it (same
    compiler file, same CPU, same ISA), else computed and written there atomically: the compiler runs once per
    toolchain and CPU, not three times in every process. An unreadable, foreign or group-writable probe file is
    recomputed."""
    stamp = hashlib.sha256(("\n".join([C_SOURCE, " ".join(_flags(isa)), _toolchain_stamp(cc)])).encode()).hexdigest()
    name = f"probe_{stamp[:24]}.json"
    try:
        fd, _ = _open_checked(folder, name)
        if fd is not None:
            with os.fdopen(fd, encoding="utf-8") as fh:
                key = json.load(fh)
            if isinstance(key, dict) and set(key) == {"source", "flags", "compiler", "cpu"} and all(
                    isinstance(v, str) for v in key.values()) and key["source"] == C_SOURCE:
                return key
    except (OSError, ValueError):
        pass
    key = _cache_key(cc, isa)
    try:
        fd, tmp = tempfile.mkstemp(prefix=".probe.", suffix=".tmp", dir=folder.anchor)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(key, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, folder.anchor / name)
    except OSError:  # a read-only cache still works: the probe just runs again next time
        pass
    return key


def _cache_tag(key: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def _why_unsafe(path: Path, st: os.stat_result, *, directory: bool) -> str | None:
    """Why ``path`` (with stat result ``st``) must not be trusted, or None when it is safe to use."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link (not followed)"
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


def _prepare_dir(folder: Path) -> tuple[_Folder | None, str | None]:
    """Create ``folder`` with mode 0700 if it is missing, open it without following a link and check the open
    folder: (the held folder, None), or (None, the reason it cannot be used)."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(folder, 0o700)
            created = True
        except FileExistsError:
            created = False
        st = os.lstat(folder)
        if stat.S_ISLNK(st.st_mode):
            return None, f"is a symbolic link (to {os.readlink(folder)}; not followed)"
        try:
            fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
        except OSError as err:
            if err.errno in (errno.ELOOP, errno.ENOTDIR):
                return None, _why_unsafe(folder, os.lstat(folder), directory=True) or f"cannot be opened ({err})"
            raise
        try:
            if created:
                os.fchmod(fd, 0o700)  # the umask may have taken bits away; never added any
            reason = _why_unsafe(folder, os.fstat(fd), directory=True)
        except OSError:
            os.close(fd)
            raise
        if reason is not None:
            os.close(fd)
            return None, reason
        return _Folder(folder, fd), None
    except OSError as err:
        return None, f"cannot be created or read ({err})"


def _build(cc: str, folder: _Folder, name: str, flags: tuple[str, ...]) -> None:
    """Compile into a temporary name in ``folder`` (reached through its descriptor), then ``os.replace`` it into
    place as ``name``."""
    where = folder.anchor
    stem = name.rsplit(".", 1)[0]
    fd, src = tempfile.mkstemp(prefix=f".{stem}.", suffix=".c", dir=where)
    with os.fdopen(fd, "w") as fh:
        fh.write(C_SOURCE)
    fd, tmp_lib = tempfile.mkstemp(prefix=f".{stem}.", suffix=".so.tmp", dir=where)
    os.close(fd)
    try:
        subprocess.run([cc, *flags, src, "-o", tmp_lib], check=True, capture_output=True, text=True,
                       timeout=120, stdin=subprocess.DEVNULL)
        os.chmod(tmp_lib, 0o700)  # the linker creates it with the umask's mode (possibly group-writable)
        fd = os.open(tmp_lib, os.O_RDONLY)
        try:
            os.fsync(fd)  # on disk before its name is: a crash never leaves a truncated library under the final name
        finally:
            os.close(fd)
        os.replace(tmp_lib, where / name)  # atomic: concurrent builders never see half a library
        _fsync_folder(folder)
    finally:
        for leftover in (src, tmp_lib):
            try:
                os.unlink(leftover)
            except FileNotFoundError:
                pass


def _fsync_folder(folder: _Folder) -> None:
    try:
        os.fsync(folder.fd)
    except OSError:
        pass


def _open(lib_path: Path | str):
    lib = ctypes.CDLL(str(lib_path))
    lib.trl_fp8_sr_bf16.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint32, ctypes.c_int,
                                    ctypes.c_int64]
    lib.trl_fp8_sr_bf16.restype = None
    lib.trl_fp8_ef_bf16.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    lib.trl_fp8_ef_bf16.restype = None
    lib.trl_fp8_first_unequal.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                          ctypes.c_void_p]
    lib.trl_fp8_first_unequal.restype = ctypes.c_int64
    lib.trl_fp8_logprob_stats.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                          ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                          ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    lib.trl_fp8_logprob_stats.restype = ctypes.c_int
    return lib


# Descriptors of the libraries loaded through /proc/self/fd/N, kept open for the life of the process: the dynamic
# loader knows a library by the name it was opened with, so N must never name another file in this process.
_HELD_FDS: list[int] = []


def _open_by_fd(fd: int, folder: _Folder, name: str):
    """Load the very file open as ``fd`` (checked by :func:`_open_checked`): through ``/proc/self/fd/N`` where the
    OS has it (``fd`` then stays open, see ``_HELD_FDS``); elsewhere by its name in the held folder after checking
    that the name still is that file."""
    proc = f"/proc/self/fd/{fd}"
    if _same_file(Path(proc), fd):
        lib = _open(proc)
        _HELD_FDS.append(fd)
        return lib
    st, now = os.fstat(fd), os.stat(name, dir_fd=folder.fd, follow_symlinks=False)
    if (st.st_dev, st.st_ino) != (now.st_dev, now.st_ino):
        raise OSError(f"{folder.path / name} was replaced after it was checked")
    return _open(folder.path / name)


def _refuse(what: str, path: Path, reason: str) -> None:
    warnings.warn(f"trl_fp8: not using the fused Fair Cast CPU kernels: the cache {what} {path} {reason}; "
                  "using the PyTorch implementation (same results, slower). Make it a real folder (not a link) "
                  "owned by you and not group/other-writable (chmod 700), or point TRL_FP8_CACHE at another folder.",
                  stacklevel=4)


@functools.lru_cache(maxsize=None)
def load(isa: str | None = None):
    """The compiled kernel library (a ``ctypes.CDLL``), or None when it cannot be built or trusted here.

    ``isa``: one of :data:`ISAS` (default: ``$TRL_FP8_NATIVE_ISA``, else ``native``); anything else raises
    ``ValueError``."""
    isa = resolve_isa(isa)
    if os.environ.get("TRL_FP8_NO_NATIVE", "") not in ("", "0") or sys.platform == "win32":
        return None
    cc = _compiler()
    if cc is None:
        wanted = os.environ.get("CC", "").strip()
        if wanted and wanted not in _CC_WARNED:
            _CC_WARNED.add(wanted)
            warnings.warn(f"trl_fp8: CC={wanted!r} names no program found (through PATH, or as a path); the Fair Cast "
                          "exports use the PyTorch implementation (same results, slower). Set CC to a C compiler, or "
                          "unset it to use cc, gcc or clang from PATH.", RuntimeWarning, stacklevel=2)
        return None
    folder_path = _cache_dir()
    folder, reason = _prepare_dir(folder_path)
    if folder is None:
        _refuse("folder", folder_path, reason)
        return None
    try:
        return _load_from(cc, folder, isa)
    finally:
        folder.close()


def _load_from(cc: str, folder: _Folder, isa: str):
    name = f"trl_fp8_{_cache_tag(_probed_key(cc, folder, isa))}.so"
    lib_path = folder.path / name
    for attempt in (1, 2):
        try:
            fd, reason = _open_checked(folder, name)
        except FileNotFoundError:
            try:
                _build(cc, folder, name, _flags(isa))
            except (OSError, subprocess.SubprocessError) as err:
                detail = getattr(err, "stderr", "") or str(err)
                warnings.warn(f"trl_fp8: could not build the fused Fair Cast CPU kernels ({detail.strip()[:200]}); "
                              "using the PyTorch implementation (same results, slower).", stacklevel=3)
                return None
            try:
                fd, reason = _open_checked(folder, name)
            except FileNotFoundError as err:
                fd, reason = None, f"cannot be read ({err})"
        if reason is not None:
            _refuse("library", lib_path, reason)
            return None
        try:
            return _open_by_fd(fd, folder, name)
        except (OSError, AttributeError) as err:  # truncated, corrupt, or without our symbols
            if attempt == 2:
                warnings.warn(f"trl_fp8: the freshly built Fair Cast CPU kernels {lib_path} do not load ({err}); "
                              "using the PyTorch implementation (same results, slower).", stacklevel=3)
                return None
            warnings.warn(f"trl_fp8: the cached Fair Cast CPU kernels {lib_path} do not load ({err}); rebuilding "
                          "them once.", stacklevel=3)
            try:
                os.unlink(name, dir_fd=folder.fd)
            except FileNotFoundError:
                pass
            except OSError as unlink_err:
                warnings.warn(f"trl_fp8: cannot remove {lib_path} ({unlink_err}); using the PyTorch "
                              "implementation (same results, slower).", stacklevel=3)
                return None
        finally:
            if fd is not None and fd not in _HELD_FDS:
                os.close(fd)
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


_HOST_TENSORS = (torch.Tensor, torch.nn.Parameter)  # plain tensors: data_ptr() is their own strided memory


def _comparable(name: str, t) -> None:
    if type(t) not in _HOST_TENSORS or not t.is_cpu or t.layout is not torch.strided or not t.is_contiguous():
        raise ValueError(f"{name} must be a plain contiguous CPU tensor, got {type(t).__name__} on "
                         f"{getattr(t, 'device', '?')}")
    if t.dtype.is_complex and (t.is_conj() or t.is_neg()):
        raise ValueError(f"{name} is a lazily conjugated or negated view: its bits are not its values")


def comparable_pair(a, b, i: int = 0) -> tuple[int, int, int, int]:
    """What :func:`first_unequal` passes the library for the pair ``(a, b)`` (its ``i``-th): ``(address of a, address
    of b, size, kind)`` — bytes for one dtype (kind 0), elements for float32 against bfloat16 (kind 1). Checks both
    tensors first (plain, contiguous, on the CPU, one number of elements, one of those dtype combinations) and
    raises ``ValueError`` naming what fails. Called on every sync with a model's worth of pairs: the common case is
    tested at once, with :func:`_comparable` to say what fails."""
    if not (type(a) in _HOST_TENSORS and type(b) in _HOST_TENSORS and a.is_cpu and b.is_cpu
            and a.layout is torch.strided and b.layout is torch.strided and a.is_contiguous() and b.is_contiguous()):
        _comparable(f"pair {i}: a", a)
        _comparable(f"pair {i}: b", b)
    n, dtype = a.numel(), a.dtype
    if b.numel() != n:
        raise ValueError(f"pair {i}: {n} elements against {b.numel()}")
    if dtype is b.dtype:
        if dtype.is_complex:
            _comparable(f"pair {i}: a", a)
            _comparable(f"pair {i}: b", b)
        return a.data_ptr(), b.data_ptr(), n * a.element_size(), 0
    if dtype is torch.float32 and b.dtype is torch.bfloat16:
        return a.data_ptr(), b.data_ptr(), n, 1
    raise ValueError(f"pair {i}: {dtype} against {b.dtype} (one dtype, or float32 against bfloat16)")


def first_unequal(lib, pairs) -> int:
    """The index of the first pair ``(a, b)`` whose bits differ, or -1, in one call into ``lib``: ``a`` and ``b`` of
    one dtype compare their bytes; ``a`` float32 and ``b`` bfloat16 compare ``a`` with ``b`` widened (exact). Every
    pair is checked first (:func:`comparable_pair`): anything else raises ``ValueError`` before the library sees a
    pointer. The caller keeps the tensors alive for the call (``pairs`` holds them)."""
    return first_unequal_checked(lib, [comparable_pair(a, b, i) for i, (a, b) in enumerate(pairs)])


def first_unequal_checked(lib, entries) -> int:
    """:func:`first_unequal` on pairs already checked: ``entries`` as :func:`comparable_pair` returns them (the
    caller keeps their tensors alive for the call)."""
    count = len(entries)
    if count == 0:
        return -1
    addresses_a, addresses_b, sizes, kinds = zip(*entries)
    return int(lib.trl_fp8_first_unequal(count, (ctypes.c_uint64 * count)(*addresses_a),
                                         (ctypes.c_uint64 * count)(*addresses_b), (ctypes.c_int64 * count)(*sizes),
                                         (ctypes.c_int32 * count)(*kinds)))
