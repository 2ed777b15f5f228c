"""The compiled CPU kernels (trl_fp8.native): cache key, cache permissions, atomic builds,
argument checks before raw-pointer calls, and the PyTorch fallback when no compiler is available.

Every test runs with ``TRL_FP8_CACHE`` pointing into its own ``tmp_path``; tests that need a real C compiler
skip without one."""

import os
import platform
import shutil
import stat
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from trl_fp8 import native as _native
from trl_fp8.fair_cast import rounding as R

SPECIALS = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 3.4e38, -3.4e38, 1e-40, -1e-40, 1.0, -1.0]

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="the native kernels are not built on Windows")


def _need_cc():
    if _native._compiler() is None:
        pytest.skip("skipped: no cc")


def _bits(t):
    return t.view(torch.int16)


def _libs(cache):
    """What the cache folder holds besides the compiler probes (libraries, temporaries)."""
    return sorted(p for p in cache.iterdir() if not p.name.startswith("probe_"))


def _mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """A private cache folder (never the user's home) and a fresh ``load()`` before and after each test."""
    folder = tmp_path / "cache" / "trl_fp8"
    monkeypatch.setenv("TRL_FP8_CACHE", str(folder))
    monkeypatch.delenv("TRL_FP8_NO_NATIVE", raising=False)
    _native.load.cache_clear()
    yield folder
    _native.load.cache_clear()


@pytest.fixture
def fake_toolchain(monkeypatch):
    """A pretend compiler and CPU, and a build that records its target instead of compiling: the cache logic
    without a C compiler. ``env`` holds the compiler identity and CPU features the cache key sees."""
    env = {"compiler": "fakecc 1.0", "cpu": "x86_64 flags: sse2 avx2", "built": []}

    def build(cc, folder, name, flags):
        lib_path = folder.anchor / name  # through the held folder, as the real build writes
        env["built"].append(Path(os.path.realpath(lib_path)))
        lib_path.write_bytes(b"not really a library")
        os.chmod(lib_path, 0o700)

    monkeypatch.setattr(_native, "_compiler", lambda: "/fake/bin/cc")
    monkeypatch.setattr(_native, "_compiler_identity", lambda cc: env["compiler"])
    monkeypatch.setattr(_native, "_cpu_features", lambda cc, isa="native": env["cpu"])
    monkeypatch.setattr(_native, "_toolchain_stamp", lambda cc: f"{env['compiler']}|{env['cpu']}")
    monkeypatch.setattr(_native, "_build", build)
    # "loads" the file it is handed: records the file's name (the /proc/self/fd link resolved) and its bytes
    monkeypatch.setattr(_native, "_open", lambda path: ("lib", Path(os.path.realpath(path)), Path(path).read_bytes()))
    return env


def _load_quietly():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning expected
        return _native.load()


def _load_refused(match):
    with pytest.warns(UserWarning) as record:
        assert _native.load() is None
    messages = [str(w.message) for w in record if "trl_fp8" in str(w.message)]
    assert len(messages) == 1, messages
    assert match in messages[0]
    return messages[0]


# ---------------------------------------------------------------------------------------------- real build


def test_native_kernel_builds_into_a_private_cache(cache):
    _need_cc()
    lib = _load_quietly()
    assert lib is not None
    assert _mode(cache) == 0o700
    files = sorted(p.name for p in cache.iterdir() if not p.name.startswith("probe_"))
    assert len(files) == 1 and files[0].startswith("trl_fp8_") and files[0].endswith(".so"), files  # no temps
    lib_file = cache / files[0]
    assert os.stat(lib_file).st_uid == os.geteuid()
    assert _mode(lib_file) & 0o022 == 0
    assert _native.load() is lib  # built once per process

    x = torch.cat([torch.randn(4099) * 0.1, torch.tensor(SPECIALS)])
    key = R.derive_key(3, 7, 1)
    sr = _native.sr_bf16(lib, x, None, key, 2)
    assert torch.equal(_bits(sr), _bits(R._sr_bf16_bits_torch(x, key)))
    r1 = torch.randn_like(x) * 1e-4
    r1[-len(SPECIALS):] = 0
    r2 = r1.clone()
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    assert _native.ef_bf16(lib, x, r1, out, 2) is out
    assert torch.equal(_bits(out), _bits(R._error_feedback_torch(x, r2, torch.bfloat16)))
    assert torch.equal(r1, r2)


def test_failed_build_leaves_no_library_and_no_temporaries(cache, tmp_path, monkeypatch):
    # a "compiler" that writes half a library and fails: nothing may end up under the cached name
    fake = tmp_path / "bin" / "cc"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\nwhile [ "$#" -gt 0 ]; do\n  if [ "$1" = "-o" ]; then printf half > "$2"; fi\n'
                    '  shift\ndone\necho "cc: error: simulated failure" >&2\nexit 1\n')
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    with pytest.warns(UserWarning, match="could not build"):
        assert _native.load() is None
    assert _libs(cache) == []


def test_build_writes_a_temporary_in_the_same_folder_then_replaces(cache, monkeypatch):
    _need_cc()
    moves = []
    real_replace = os.replace

    def spy(src, dst):  # the build reaches the folder through its descriptor (/proc/<pid>/fd/N): resolved here
        moves.append((Path(os.path.realpath(src)), Path(os.path.realpath(dst)), Path(src).read_bytes()[:4]))
        real_replace(src, dst)

    monkeypatch.setattr(_native.os, "replace", spy)
    assert _native.load() is not None
    moves = [m for m in moves if not m[1].name.startswith("probe_")]  # the compiler probe is replaced atomically too
    (tmp, dst, magic), = moves
    assert tmp.parent == dst.parent == cache and tmp != dst
    assert dst.name.startswith("trl_fp8_") and magic in (b"\x7fELF", b"\xcf\xfa\xed\xfe")  # a whole library
    assert [p.name for p in _libs(cache)] == [dst.name]


# ---------------------------------------------------------------------------------------------- cache key


def test_cache_key_holds_source_flags_compiler_version_and_cpu_flags():
    _need_cc()
    cc = _native._compiler()
    key = _native._cache_key(cc)
    assert key["source"] == _native.C_SOURCE
    assert "-march=native" in key["flags"] and "-O3" in key["flags"]
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.strip()
    assert version and version in key["compiler"]
    assert platform.machine() in key["cpu"]
    if os.path.exists("/proc/cpuinfo"):  # -march=native: the key must hold the CPU's feature flags
        with open("/proc/cpuinfo") as fh:
            flags = [line.partition(":")[2].split() for line in fh
                     if line.partition(":")[0].strip() in ("flags", "Features")]
        if flags:
            assert " ".join(flags[0]) in key["cpu"]
    assert _native._cache_tag(key) == _native._cache_tag(_native._cache_key(cc))  # deterministic


@pytest.mark.parametrize("part", ["source", "flags", "compiler", "cpu"])
def test_cache_tag_changes_with_every_part_of_the_key(part):
    key = {"source": "int f(void);", "flags": "-O3 -march=native", "compiler": "gcc 12.2", "cpu": "flags: avx2"}
    changed = dict(key, **{part: key[part] + " x"})
    assert _native._cache_tag(changed) != _native._cache_tag(key)
    assert _native._cache_tag(dict(key)) == _native._cache_tag(key)


def test_cache_from_another_cpu_or_compiler_is_not_reused(cache, fake_toolchain):
    env = fake_toolchain
    assert _load_quietly()[0] == "lib"
    first = env["built"][0]
    _native.load.cache_clear()
    assert _load_quietly()[1] == first and len(env["built"]) == 1  # same machine: reused, not rebuilt

    env["cpu"] = "x86_64 flags: sse2"  # another CPU (no avx2)
    _native.load.cache_clear()
    assert _load_quietly()[1] != first and len(env["built"]) == 2

    env["compiler"] = "fakecc 2.0"  # another compiler
    _native.load.cache_clear()
    assert _load_quietly()[1] not in env["built"][:2] and len(env["built"]) == 3
    assert len({p.name for p in _libs(cache)}) == 3


def test_flags_and_source_are_in_the_library_name(cache, fake_toolchain, monkeypatch):
    _load_quietly()
    monkeypatch.setattr(_native, "FLAGS", _native.FLAGS + ("-DEXTRA",))
    _native.load.cache_clear()
    _load_quietly()
    monkeypatch.setattr(_native, "C_SOURCE", _native.C_SOURCE + "\n/* changed */\n")
    _native.load.cache_clear()
    _load_quietly()
    assert len(set(fake_toolchain["built"])) == 3


# ---------------------------------------------------------------------------------------------- permissions


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077])
def test_cache_folder_is_created_0700(cache, fake_toolchain, umask):
    old = os.umask(umask)
    try:
        assert _load_quietly() is not None
    finally:
        os.umask(old)
    assert _mode(cache) == 0o700


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o777, 0o720])
def test_group_or_other_writable_folder_is_refused(cache, fake_toolchain, mode):
    cache.mkdir(parents=True)
    cache.chmod(mode)
    message = _load_refused("group- or other-writable")
    assert str(cache) in message and "PyTorch" in message
    assert fake_toolchain["built"] == [] and _libs(cache) == []


def test_folder_owned_by_someone_else_is_refused(cache, fake_toolchain, monkeypatch):
    cache.mkdir(parents=True, mode=0o700)
    monkeypatch.setattr(_native, "_current_uid", lambda: os.stat(cache).st_uid + 1)
    message = _load_refused("not by the current user")
    assert str(cache) in message and fake_toolchain["built"] == []


def test_folder_that_is_a_file_is_refused(cache, fake_toolchain):
    cache.parent.mkdir(parents=True)
    cache.write_text("")
    assert str(cache) in _load_refused("is not a directory")
    assert fake_toolchain["built"] == []


@pytest.mark.parametrize("mode", [0o775, 0o757, 0o666])
def test_writable_existing_library_is_refused(cache, fake_toolchain, mode):
    assert _load_quietly() is not None
    lib_path = fake_toolchain["built"][0]
    lib_path.chmod(mode)
    _native.load.cache_clear()
    message = _load_refused("group- or other-writable")
    assert str(lib_path) in message and len(fake_toolchain["built"]) == 1  # neither loaded nor rebuilt


def test_symlinked_library_is_refused(cache, fake_toolchain, tmp_path):
    assert _load_quietly() is not None
    lib_path = fake_toolchain["built"][0]
    elsewhere = tmp_path / "elsewhere.so"
    lib_path.rename(elsewhere)
    lib_path.symlink_to(elsewhere)
    _native.load.cache_clear()
    assert str(lib_path) in _load_refused("is a symbolic link (not followed)")


def test_symlinked_cache_folder_is_refused(cache, fake_toolchain, tmp_path):
    # TRL_FP8_CACHE names a link to a private-looking folder elsewhere: the link is not followed
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    cache.parent.mkdir(parents=True)
    cache.symlink_to(target)
    message = _load_refused("is a symbolic link")
    assert str(cache) in message and str(target) in message
    assert fake_toolchain["built"] == [] and list(target.iterdir()) == []  # nothing built or written through it


def test_fifo_in_place_of_the_library_is_refused_without_blocking(cache, fake_toolchain):
    assert _load_quietly() is not None
    lib_path = fake_toolchain["built"][0]
    lib_path.unlink()
    os.mkfifo(lib_path, 0o600)  # opening a FIFO for reading would wait for a writer: opened non-blocking
    _native.load.cache_clear()
    assert str(lib_path) in _load_refused("is not a regular file")


def test_the_library_loaded_is_the_file_checked_not_what_the_name_holds_later(cache, fake_toolchain, monkeypatch):
    assert _load_quietly() is not None
    lib_path = fake_toolchain["built"][0]
    good = lib_path.read_bytes()
    real_open_checked = _native._open_checked
    seen = []

    def swap_after_check(folder, name):
        fd, reason = real_open_checked(folder, name)
        if name != lib_path.name:  # the compiler probe
            return fd, reason
        seen.append(os.fstat(fd))
        evil = cache / "evil.tmp"  # between the check and the load, the name is replaced (as a racing writer would)
        evil.write_bytes(b"evil library")
        evil.chmod(0o700)
        os.replace(evil, lib_path)
        return fd, reason

    monkeypatch.setattr(_native, "_open_checked", swap_after_check)
    _native.load.cache_clear()
    kind, loaded_from, loaded_bytes = _load_quietly()
    assert loaded_bytes == good and lib_path.read_bytes() == b"evil library"  # the checked file was loaded
    assert len(seen) == 1 and stat.S_ISREG(seen[0].st_mode)


def test_the_folder_replaced_after_the_check_is_not_the_one_used(cache, fake_toolchain, monkeypatch, tmp_path):
    real_prepare = _native._prepare_dir
    moved = tmp_path / "moved"
    planted = tmp_path / "planted"

    def swap_after_check(folder):
        held, reason = real_prepare(folder)
        os.rename(cache, moved)  # the checked folder is renamed away and a link to another folder put in its place
        planted.mkdir(mode=0o700)
        cache.symlink_to(planted)
        return held, reason

    monkeypatch.setattr(_native, "_prepare_dir", swap_after_check)
    kind, loaded_from, _ = _load_quietly()
    assert loaded_from.parent == moved and fake_toolchain["built"] == [loaded_from]  # built and loaded in the held one
    assert list(planted.iterdir()) == []  # nothing reached through the planted link


def test_the_real_library_loads_through_its_descriptor_despite_a_swap(cache, monkeypatch):
    _need_cc()
    assert _native.load() is not None  # built
    lib_path, = [p for p in _libs(cache) if p.suffix == ".so"]
    real_open_checked = _native._open_checked

    def swap_after_check(folder, name):
        fd, reason = real_open_checked(folder, name)
        if name != lib_path.name:  # the compiler probe
            return fd, reason
        evil = cache / "evil.tmp"
        evil.write_bytes(b"\x7fELF not a library")
        evil.chmod(0o700)
        os.replace(evil, lib_path)
        return fd, reason

    monkeypatch.setattr(_native, "_open_checked", swap_after_check)
    _native.load.cache_clear()
    lib = _load_quietly()  # no "do not load" warning: the checked file was dlopen'ed, not the garbage now named so
    x = torch.randn(999)
    key = R.derive_key(5, 6, 7)
    assert torch.equal(_bits(_native.sr_bf16(lib, x, None, key, 1)), _bits(R._sr_bf16_bits_torch(x, key)))


def test_library_owned_by_someone_else_is_refused(tmp_path, monkeypatch):
    lib = tmp_path / "trl_fp8_x.so"
    lib.write_bytes(b"")
    lib.chmod(0o700)
    st = os.lstat(lib)
    assert _native._why_unsafe(lib, st, directory=False) is None
    monkeypatch.setattr(_native, "_current_uid", lambda: st.st_uid + 1)
    assert "not by the current user" in _native._why_unsafe(lib, st, directory=False)


# ---------------------------------------------------------------------------------------------- argument checks


class _RecordingLib:
    """Stands in for the CDLL: the checks must raise before any raw pointer reaches it."""

    def __init__(self):
        self.calls = []

    def trl_fp8_sr_bf16(self, *args):
        self.calls.append(("sr", args))

    def trl_fp8_ef_bf16(self, *args):
        self.calls.append(("ef", args))

    def trl_fp8_first_unequal(self, *args):
        self.calls.append(("compare", args))
        return -1


def _src():
    return torch.randn(4, 6)


def _bf16(shape=(4, 6)):
    return torch.empty(shape, dtype=torch.bfloat16)


SR_BAD = {
    "src dtype": (dict(src=torch.randn(4, 6, dtype=torch.float64)), TypeError, "src must have dtype torch.float32"),
    "src type": (dict(src=[1.0, 2.0]), TypeError, "src must be a torch.Tensor"),
    "src strided": (dict(src=torch.randn(6, 4).t()), ValueError, "src must be contiguous"),
    "src device": (dict(src=torch.empty(4, 6, device="meta")), ValueError, "src must be on the CPU"),
    "out dtype fp16": (dict(out=torch.empty(4, 6, dtype=torch.float16)), TypeError,
                       "out must have dtype torch.bfloat16"),
    "out dtype fp32": (dict(out=torch.empty(4, 6)), TypeError, "out must have dtype torch.bfloat16"),
    "out shape": (dict(out=_bf16((4, 7))), ValueError, r"out must have shape \(4, 6\)"),
    "out same numel": (dict(out=_bf16((6, 4))), ValueError, r"out must have shape \(4, 6\)"),
    "out strided": (dict(out=_bf16((6, 4)).t()), ValueError, "out must be contiguous"),
    "out device": (dict(out=torch.empty(4, 6, dtype=torch.bfloat16, device="meta")), ValueError,
                   "out must be on the CPU"),
    "key negative": (dict(key=-1), ValueError, "key must be"),
    "key too big": (dict(key=2**32), ValueError, "key must be"),
    "nthreads zero": (dict(nthreads=0), ValueError, "nthreads must be"),
}


@pytest.mark.parametrize("case", sorted(SR_BAD))
def test_sr_bf16_rejects_bad_arguments_before_the_call(case):
    change, error, match = SR_BAD[case]
    args = dict(src=_src(), out=_bf16(), key=123, nthreads=1)
    args.update(change)
    lib = _RecordingLib()
    with pytest.raises(error, match=match):
        _native.sr_bf16(lib, args["src"], args["out"], args["key"], args["nthreads"])
    assert lib.calls == []


EF_BAD = {
    "src dtype": (dict(src=torch.randn(4, 6).bfloat16()), TypeError, "src must have dtype torch.float32"),
    "src strided": (dict(src=torch.randn(6, 4).t()), ValueError, "src must be contiguous"),
    "residual dtype": (dict(residual=torch.zeros(4, 6, dtype=torch.float64)), TypeError,
                       "residual must have dtype torch.float32"),
    "residual bf16": (dict(residual=_bf16()), TypeError, "residual must have dtype torch.float32"),
    "residual shape": (dict(residual=torch.zeros(24)), ValueError, r"residual must have shape \(4, 6\)"),
    "residual strided": (dict(residual=torch.zeros(6, 4).t()), ValueError, "residual must be contiguous"),
    "residual device": (dict(residual=torch.zeros(4, 6, device="meta")), ValueError, "residual must be on the CPU"),
    "out dtype": (dict(out=torch.empty(4, 6, dtype=torch.float16)), TypeError, "out must have dtype torch.bfloat16"),
    "out shape": (dict(out=_bf16((5, 6))), ValueError, r"out must have shape \(4, 6\)"),
    "out strided": (dict(out=_bf16((6, 4)).t()), ValueError, "out must be contiguous"),
    "out device": (dict(out=torch.empty(4, 6, dtype=torch.bfloat16, device="meta")), ValueError,
                   "out must be on the CPU"),
    "nthreads bool": (dict(nthreads=True), ValueError, "nthreads must be"),
}


@pytest.mark.parametrize("case", sorted(EF_BAD))
def test_ef_bf16_rejects_bad_arguments_before_the_call(case):
    change, error, match = EF_BAD[case]
    args = dict(src=_src(), residual=torch.zeros(4, 6), out=_bf16(), nthreads=1)
    args.update(change)
    lib = _RecordingLib()
    with pytest.raises(error, match=match):
        _native.ef_bf16(lib, args["src"], args["residual"], args["out"], args["nthreads"])
    assert lib.calls == []


def test_good_arguments_reach_the_library_unchanged():
    lib = _RecordingLib()
    src, residual, out = _src(), torch.zeros(4, 6), _bf16()
    assert _native.sr_bf16(lib, src, out, 2**32 - 1, 3) is out
    assert _native.ef_bf16(lib, src, residual, out, 2) is out
    allocated = _native.sr_bf16(lib, src, None, 0, 1)
    assert allocated.dtype == torch.bfloat16 and allocated.shape == src.shape
    assert lib.calls[0] == ("sr", (src.data_ptr(), out.data_ptr(), 24, 2**32 - 1, 3, 0))
    assert lib.calls[1] == ("ef", (src.data_ptr(), residual.data_ptr(), out.data_ptr(), 24, 2))


# ---------------------------------------------------------------------------------------------- cache edges


def test_a_corrupt_cached_library_is_rebuilt_once_with_a_warning(cache):
    _need_cc()
    cc = _native._compiler()
    folder, reason = _native._prepare_dir(cache)
    assert reason is None
    lib_file = cache / f"trl_fp8_{_native._cache_tag(_native._probed_key(cc, folder))}.so"
    folder.close()
    # what a crash of an unsynced writer leaves: the right name, a cut file (never loaded by this process before:
    # overwriting a library a process has mapped would crash that process, not test this)
    lib_file.write_bytes(b"\x7fELF\x02\x01\x01" + bytes(64))
    os.chmod(lib_file, 0o700)
    with pytest.warns(UserWarning, match="do not load .*rebuilding them once"):
        lib = _native.load()
    assert lib is not None  # rebuilt: the fused kernel is back, not off for good
    x = torch.randn(1000)
    key = R.derive_key(1, 2, 3)
    assert torch.equal(_bits(_native.sr_bf16(lib, x, None, key, 1)), _bits(R._sr_bf16_bits_torch(x, key)))
    assert lib_file.stat().st_size > 1000


def test_a_library_that_never_loads_is_rebuilt_once_then_given_up(cache, fake_toolchain, monkeypatch):
    def broken(path):
        raise OSError(f"{path}: invalid ELF header")

    monkeypatch.setattr(_native, "_open", broken)
    with pytest.warns(UserWarning) as record:
        assert _native.load() is None
    messages = [str(w.message) for w in record]
    assert len(fake_toolchain["built"]) == 2, fake_toolchain["built"]  # the first build, one rebuild, no more
    assert "rebuilding them once" in messages[0] and "freshly built" in messages[1], messages


def test_the_compiler_probe_runs_once_per_toolchain_not_per_process(cache, monkeypatch):
    _need_cc()
    calls = []
    real = _native._run_text
    monkeypatch.setattr(_native, "_run_text", lambda cmd: calls.append(cmd) or real(cmd))
    first = _load_quietly()
    assert first is not None and len(calls) == 3  # --version, -dumpmachine, the -march=native macros
    probes = [p for p in cache.iterdir() if p.name.startswith("probe_")]
    assert len(probes) == 1 and _mode(probes[0]) & 0o022 == 0
    _native.load.cache_clear()  # as a new process would
    assert _load_quietly() is not None
    assert len(calls) == 3  # the cached probe named the same library: no compiler run at all
    probes[0].write_text("{not json")  # a damaged probe is recomputed, never trusted
    _native.load.cache_clear()
    assert _load_quietly() is not None and len(calls) == 6
    assert len([p for p in cache.iterdir() if p.suffix == ".so"]) == 1  # the same key, the same library


def test_a_failed_compile_is_remembered_in_the_module_not_the_environment(monkeypatch):
    monkeypatch.delenv("TRL_FP8_NO_COMPILE", raising=False)
    monkeypatch.setitem(R._COMPILE, "usable", True)
    calls = []

    def failing():
        calls.append(1)
        raise RuntimeError("inductor: no triton")

    monkeypatch.setattr(R, "_compiled_sr_bf16_bits", failing)
    monkeypatch.setattr(R, "_sr_bf16_bits_torch", lambda src, key, offset: torch.zeros(8, dtype=torch.bfloat16))
    # only the device is read on this path: a stand-in for a CUDA tensor on a machine without one
    on_cuda = type("CudaTensor", (), {"device": torch.device("cuda"), "shape": torch.Size([8])})()
    out = torch.empty(8, dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match="torch.compile of the SR kernel failed"):
        R._sr_bf16(on_cuda, 5, out)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        R._sr_bf16(on_cuda, 5, out)  # not tried again, not said again
    assert calls == [1]
    assert "TRL_FP8_NO_COMPILE" not in os.environ  # children of this process still may compile
    assert "no triton" in R._COMPILE["error"]


# ---------------------------------------------------------------------------------------------- no compiler


def test_missing_compiler_falls_back_to_torch_with_identical_bits(cache, tmp_path, monkeypatch):
    x = torch.cat([torch.randn(5003) * 0.1, torch.tensor(SPECIALS)])
    key = R.derive_key(11, 4, 3)
    expected_sr = R._sr_bf16_bits_torch(x, key)
    r_expected = torch.randn_like(x) * 1e-4
    r_expected[-len(SPECIALS):] = 0
    r_used = r_expected.clone()
    expected_ef = R._error_feedback_torch(x, r_expected, torch.bfloat16)

    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.delenv("CC", raising=False)
    assert _native._compiler() is None
    assert _load_quietly() is None
    assert not os.path.exists(cache)  # nothing built, nothing created

    used = []
    real_sr, real_ef = R._sr_bf16_bits_torch, R._error_feedback_torch
    monkeypatch.setattr(R, "_sr_bf16_bits_torch", lambda *a: used.append("sr") or real_sr(*a))
    monkeypatch.setattr(R, "_error_feedback_torch", lambda *a: used.append("ef") or real_ef(*a))
    got_sr = R.stochastic_round(x, seed=11, step=4, index=3)
    got_ef = R.error_feedback_round(x, r_used)
    assert used == ["sr", "ef"]  # the PyTorch path ran
    assert torch.equal(_bits(got_sr), _bits(expected_sr))
    assert torch.equal(_bits(got_ef), _bits(expected_ef))
    assert torch.equal(r_used, r_expected)


def test_no_native_env_var_disables_the_kernels(cache, fake_toolchain, monkeypatch):
    monkeypatch.setenv("TRL_FP8_NO_NATIVE", "1")
    assert _load_quietly() is None
    assert fake_toolchain["built"] == [] and not os.path.exists(cache)


def test_compiler_lookup_honours_cc(tmp_path, monkeypatch):
    fake = tmp_path / "mycc"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    assert _native._compiler() == shutil.which(str(fake))


# ---------------------------------------------------------------------------------------------- instruction sets


def _has_avx2_build():
    _need_cc()
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("skipped: the avx2 build is for x86-64")


def _sr_cases():
    """Inputs that walk every branch of the block kernel: blocks without specials (fast path only), one special in
    the middle of a later block (that block redone), finite values whose sum overflows, a ragged last block."""
    block = 4096
    x = torch.randn(3 * block + 77) * 0.1
    x[block + 1000: block + 1000 + len(SPECIALS)] = torch.tensor(SPECIALS)
    x[2 * block + 5] = 3.3961e38  # finite, close enough to max that + r may overflow: saturates
    x[-3:] = torch.tensor([float("nan"), 1e-39, -3.3961e38])
    return x


@pytest.mark.parametrize("isa", ["native", "avx2"])
@pytest.mark.parametrize("offset", [0, 4095, 2**32 - 3000, 2**40 + 17])
def test_every_isa_build_gives_the_pytorch_bits(cache, isa, offset):
    if isa == "avx2":
        _has_avx2_build()
    _need_cc()
    lib = _native.load(isa)
    assert lib is not None
    x = _sr_cases()
    key = R.derive_key(9, 2, 4)
    assert torch.equal(_bits(_native.sr_bf16(lib, x, None, key, 2, offset)),
                       _bits(R._sr_bf16_bits_torch(x, key, offset)))
    for lo, hi in ((0, 4096), (4096, 2 * 4096), (100, 9000)):  # shards starting anywhere draw the whole tensor's bits
        part = _native.sr_bf16(lib, x[lo:hi].contiguous(), None, key, 1, offset + lo)
        assert torch.equal(_bits(part), _bits(R._sr_bf16_bits_torch(x, key, offset)[lo:hi]))


@pytest.mark.parametrize("isa", ["native", "avx2"])
def test_every_isa_build_gives_the_pytorch_error_feedback(cache, isa):
    if isa == "avx2":
        _has_avx2_build()
    _need_cc()
    lib = _native.load(isa)
    x = _sr_cases()
    r1 = torch.randn_like(x) * 1e-3
    r1[x.abs() > 1e38] = 3e37  # pushes the near-max values over: saturates
    r2 = r1.clone()
    for _ in range(3):  # the residual carries over exports
        out = _native.ef_bf16(lib, x, r1, None, 2)
        assert torch.equal(_bits(out), _bits(R._error_feedback_torch(x, r2, torch.bfloat16)))
        assert torch.equal(r1, r2)
    assert not torch.isfinite(r1).logical_not().any() and (r1[~torch.isfinite(x)] == 0).all()


def test_the_avx2_build_is_its_own_library_without_avx512(cache):
    _has_avx2_build()
    native, avx2 = _native.load("native"), _native.load("avx2")
    assert native is not None and avx2 is not None and native._handle != avx2._handle
    libs = [p for p in _libs(cache) if p.suffix == ".so"]
    assert len(libs) == 2
    cc = _native._compiler()
    assert "-mno-avx512f" in _native._cache_key(cc, "avx2")["flags"]
    assert "__AVX512F__" not in _native._cpu_features(cc, "avx2") and "__AVX2__" in _native._cpu_features(cc, "avx2") \
        or "avx2" not in _native.vector_extensions()


def test_isa_comes_from_the_argument_or_the_environment_and_is_checked(monkeypatch):
    monkeypatch.delenv(_native.ISA_ENV, raising=False)
    assert _native.resolve_isa() == "native" and _native.resolve_isa("native") == "native"
    monkeypatch.setenv(_native.ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="TRL_FP8_NATIVE_ISA must be one of native, avx2; got 'sse9'"):
        _native.resolve_isa()
    with pytest.raises(ValueError, match="isa must be one of native, avx2; got 'avx512'"):
        _native.load("avx512")
    monkeypatch.setattr(_native.platform, "machine", lambda: "aarch64")
    with pytest.raises(ValueError, match="x86-64 without AVX-512; this machine is aarch64"):
        _native.resolve_isa("avx2")


def test_vector_extensions_lists_the_simd_flags_of_cpuinfo(monkeypatch):
    monkeypatch.setattr(_native, "_cpuinfo_identity", lambda: [
        "flags: fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma f16c bmi2 avx512f avx512bw", "model name: X"])
    assert _native.vector_extensions() == ["avx", "avx2", "avx512bw", "avx512f", "f16c", "fma", "sse", "sse2",
                                           "sse4_1", "sse4_2", "ssse3"]
    monkeypatch.setattr(_native, "_cpuinfo_identity", lambda: ["features: fp asimd sve crc32"])
    assert _native.vector_extensions() == ["asimd", "sve"]


# ---------------------------------------------------------------------------------------------- without /proc


def test_without_proc_the_library_is_loaded_by_name_only_if_it_still_is_the_checked_file(cache, fake_toolchain,
                                                                                        monkeypatch):
    monkeypatch.setattr(_native, "_same_file", lambda path, fd: False)  # as on an OS without /proc/self/fd
    kind, loaded_from, loaded_bytes = _load_quietly()
    lib_path = fake_toolchain["built"][0]
    assert loaded_from == lib_path and loaded_bytes == b"not really a library"  # by its name in the held folder
    real_open_checked = _native._open_checked

    def swap_after_check(folder, name):
        fd, reason = real_open_checked(folder, name)
        if name == lib_path.name:
            evil = cache / "evil.tmp"
            evil.write_bytes(b"evil library")
            evil.chmod(0o700)
            os.replace(evil, lib_path)
        return fd, reason

    monkeypatch.setattr(_native, "_open_checked", swap_after_check)
    _native.load.cache_clear()
    with pytest.warns(UserWarning) as record:
        result = _native.load()
    messages = [str(w.message) for w in record]
    assert "was replaced after it was checked" in messages[0] and "rebuilding them once" in messages[0], messages
    assert "freshly built" in messages[1] and result is None  # the rebuilt one was swapped too: given up, not loaded


def test_a_tensor_off_the_cpu_is_refused_before_the_call():
    lib = _RecordingLib()
    with pytest.raises(ValueError, match="src must be on the CPU, got device meta"):
        _native.sr_bf16(lib, torch.empty(4, device="meta"), None, 1, 1)
    assert lib.calls == []


def test_a_cc_that_names_nothing_is_not_replaced_by_another_compiler(tmp_path, monkeypatch):
    """``CC`` names the compiler: one that is not found gives no compiler and one warning naming it (the PyTorch path
    runs), not a silent build with whatever ``cc`` PATH holds."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.delenv("TRL_FP8_NO_NATIVE", raising=False)
    monkeypatch.setattr(_native, "_CC_WARNED", set())
    assert _native._compiler() is None
    with pytest.warns(RuntimeWarning, match="CC=.*no-such-cc.*names no program found"):
        assert _native.load() is None
    monkeypatch.delenv("CC")
    fake = tmp_path / "bin" / "cc"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(fake.parent))
    assert _native._compiler() == str(fake)  # without CC: found through PATH


def test_no_module_of_the_package_exceeds_600_lines():
    import trl_fp8

    root = os.path.dirname(trl_fp8.__file__)
    long = []
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    count = sum(1 for _ in f)
                if count > 600:
                    long.append(f"{os.path.relpath(os.path.join(folder, name), root)}: {count}")
    assert long == []


def test_first_unequal_compares_bytes_and_fp32_against_widened_bf16():
    _need_cc()
    lib = _load_quietly()
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(5000, generator=g), torch.tensor(SPECIALS)])
    half = x.bfloat16()
    widened = half.float()  # exactly what the bf16 values are, in fp32
    ints = torch.arange(33, dtype=torch.int64)
    pairs = [(widened, half), (x, x.clone()), (half, half.clone()), (ints, ints.clone()),
             (torch.empty(0), torch.empty(0, dtype=torch.bfloat16))]
    assert _native.first_unequal(lib, pairs) == -1
    assert _native.first_unequal(lib, []) == -1
    for index, (a, b) in enumerate(pairs[:4]):
        for position in (0, a.numel() // 2, a.numel() - 1):
            changed = a.clone()
            changed.view(torch.uint8)[position * a.element_size()] ^= 1  # one bit of one element
            trial = list(pairs)
            trial[index] = (changed, b)
            assert _native.first_unequal(lib, trial) == index
    zero = torch.zeros(3)
    assert _native.first_unequal(lib, [(zero, (-zero).bfloat16())]) == 0  # -0 is not +0
    payload = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)  # a NaN bf16 cannot hold
    assert _native.first_unequal(lib, [(payload, payload.bfloat16())]) == 0


FIRST_UNEQUAL_BAD = {
    "strided": ((torch.randn(4, 6).t(), torch.randn(4, 6).t().contiguous()), "pair 0: a must be a plain contiguous"),
    "meta": ((torch.empty(4, device="meta"), torch.empty(4)), "pair 0: a must be a plain contiguous CPU tensor"),
    "subclass": ((torch.randn(4), torch.randn(4).as_subclass(type("Wrapped", (torch.Tensor,), {}))),
                 "pair 0: b must be a plain"),
    "numel": ((torch.randn(4), torch.randn(5)), "pair 0: 4 elements against 5"),
    "dtypes": ((torch.randn(4).half(), torch.randn(4)), "torch.float16 against torch.float32"),
    "narrow first": ((torch.randn(4).bfloat16(), torch.randn(4)), "torch.bfloat16 against torch.float32"),
    "conjugate": ((torch.randn(4, dtype=torch.complex64).conj(), torch.randn(4, dtype=torch.complex64)),
                  "lazily conjugated"),
}


@pytest.mark.parametrize("case", sorted(FIRST_UNEQUAL_BAD))
def test_first_unequal_rejects_tensors_before_the_call(case):
    pair, match = FIRST_UNEQUAL_BAD[case]
    lib = _RecordingLib()
    with pytest.raises(ValueError, match=match):
        _native.first_unequal(lib, [(torch.zeros(2), torch.zeros(2)), pair][1:])
    assert lib.calls == []
    assert _native.first_unequal(lib, [(torch.zeros(2), torch.zeros(2))]) == -1 and len(lib.calls) == 1
