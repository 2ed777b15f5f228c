"""What travels to the lent GPU machine, and whether it fits: the helper of ``prepare.sh``, ``rehearse.sh`` and
``run_all.sh``. Standard library only (it runs under any ``python3``; ``packaging`` is taken from pip's vendored copy
when it is not installed).

The lent machine (the device tool's KINDS.md, ``nvidia-h200``) reaches no package registry. Its image has Python 3.12
with torch 2.11 (CUDA 13), transformers 5.17, peft, accelerate 1.15, ... (``IMAGE`` below), and lacks trl, datasets,
torchao, bitsandbytes: those travel as wheels (``CARRY``), installed there with ``pip install --no-index --no-deps
--target``. What travels is the working tree plus the carried folder, 64 MiB in all; ``prepare.sh`` refuses above 60.

    python3 benchmarks/gpu/carry.py pins                       # NAME==VERSION to carry (.ci/constraints.txt)
    python3 benchmarks/gpu/carry.py check DIR [--python 3.12]  # each wheel's Requires-Dist met by image or DIR
    python3 benchmarks/gpu/carry.py slim DIR                   # leave out what the image cannot use (SLIM)
    python3 benchmarks/gpu/carry.py size DIR [--limit-mib 60]  # the bytes a device call would send
    python3 benchmarks/gpu/carry.py env                        # (there) installed versions, requirements met
"""

from __future__ import annotations

import argparse
import email.parser
import json
import os
import re
import subprocess
import sys
import zipfile

try:
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version
except ImportError:  # pragma: no cover - a bare python3: pip always vendors packaging
    from pip._vendor.packaging.markers import default_environment
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name
    from pip._vendor.packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONSTRAINTS = os.path.join(ROOT, ".ci", "constraints.txt")
LIMIT_MIB = 60  # the device tool refuses a working tree over 64 MiB; 4 MiB of headroom for what changes meanwhile

# The wheels the checks need that the image lacks, at our own pins (.ci/constraints.txt) unless OVERRIDE says
# otherwise: each of these accepts the image's torch 2.11 / transformers 5.17 (``check`` verifies it from metadata).
# trl and datasets: GRPO itself; dill and multiprocess: datasets' requirements missing from the image (xxhash, its
# third, is there); torchao: MXFP8; bitsandbytes: fast QLoRA. deepspeed is not carried (an sdist and pydantic's
# compiled core, for the ZeRO parts of many_processes_check.py, which then say they are skipped).
CARRY = ("trl", "datasets", "dill", "multiprocess", "torchao", "bitsandbytes")
OVERRIDE: dict[str, str] = {}  # name -> version, where our pin would not install over the image's packages
# Files left out of a carried wheel (``slim``): bitsandbytes ships one native library per CUDA/ROCm/XPU release
# (41 MiB of its 41.1); the image's torch is built for CUDA 13 (2.11.0+cu130) and bitsandbytes loads the CUDA 13.x
# library nearest to it (never another major), so the CUDA 11/12, ROCm and XPU ones stay behind (-34 MiB). The CPU
# library stays (the rehearsal here loads it). ``prepare.sh --full-wheels`` keeps the wheels as published.
SLIM = {"bitsandbytes": r"^bitsandbytes/libbitsandbytes_(cuda1[0-2][0-9]|rocm[0-9]+|xpu[0-9]+)\.so$"}

# The image 'cuda' of the lent nvidia-h200 machine, as the device tool's KINDS.md lists it (read 2026-11-17): every
# package name, with the version where a session saw it (pip list, 2026-11); None: there, version not recorded.
IMAGE_VERSIONS = {
    "python": "3.12.3", "accelerate": "1.15.0", "huggingface-hub": "1.33.0", "numpy": "2.5.2", "safetensors": "0.8.0",
    "sentence-transformers": "6.0.1", "sentencepiece": "0.2.2", "tiktoken": "0.14.0", "tokenizers": "0.23.2",
    "torch": "2.11.0", "torchaudio": "2.11.0", "torchvision": "0.26.0", "transformers": "5.17.0", "triton": "3.6.0",
}
IMAGE_NAMES = """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers
flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib
kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py
markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind
narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc
nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir
onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging
pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11
py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham
simplejson six sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore
threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics
torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig
werkzeug wheel wrapt xarray xxhash yarl zipp""".split()
IMAGE = {canonicalize_name(n): IMAGE_VERSIONS.get(n) for n in IMAGE_NAMES}
# What the checks import from the image besides (recorded by ``env`` on the device, so a first run says what it met).
RECORD = ("torch", "transformers", "accelerate", "peft", "huggingface-hub", "tokenizers", "safetensors", "numpy",
          "pandas", "pyarrow", "fsspec", "xxhash", "matplotlib", "triton", *CARRY)


def pins() -> list[str]:
    """``NAME==VERSION`` for each of ``CARRY``: ``OVERRIDE``, else the pin in .ci/constraints.txt."""
    found = {}
    with open(CONSTRAINTS) as f:
        for line in f:
            m = re.match(r"^([A-Za-z0-9_.-]+)==([^\s#]+)", line)
            if m:
                found[canonicalize_name(m.group(1))] = m.group(2)
    out = []
    for name in CARRY:
        version = OVERRIDE.get(name) or found.get(canonicalize_name(name))
        if version is None:
            raise SystemExit(f"carry.py: {name} has no pin in {CONSTRAINTS} (a line '{name}==VERSION') and no "
                             f"entry in OVERRIDE in {__file__}: add one of them.")
        out.append(f"{name}=={version}")
    return out


def _wheels(folder: str) -> dict[str, tuple[str, str]]:
    """{canonical name: (version, path)} of the wheels in ``folder`` (the file name's first two fields)."""
    found = {}
    for entry in sorted(os.listdir(folder)):
        if entry.endswith(".whl"):
            name, version = entry.split("-")[:2]
            key = canonicalize_name(name)
            if key in found:
                raise SystemExit(f"carry.py: {folder} holds two wheels of {name} ({found[key][1]} and {entry}); "
                                 f"pip installs one: remove the other.")
            found[key] = (version, os.path.join(folder, entry))
    return found


def _requirements(wheel: str) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        message = email.parser.Parser().parsestr(z.read(meta).decode())
    return [Requirement(r) for r in message.get_all("Requires-Dist") or []]


def _torchao_min_torch(wheel: str) -> str | None:
    """torchao loads its compiled kernels only over torch >= the version its ``__init__`` names (else it warns and
    runs without them): that version, read from the wheel."""
    with zipfile.ZipFile(wheel) as z:
        text = z.read("torchao/__init__.py").decode()
    m = re.search(r'min_torch_version\s*=\s*_parse_version\("([0-9.]+)"\)', text)
    return m.group(1) if m else None


def check(folder: str, python: str) -> int:
    """Each carried wheel's requirements (no extras; markers for Linux x86-64 and ``python``) must be met by another
    carried wheel or by the image; a known image version must satisfy the specifier. Prints one line per wheel."""
    env = {**default_environment(), "python_version": python, "python_full_version": python + ".0",
           "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "extra": ""}
    carried = _wheels(folder)
    missing = [p for p in pins() if canonicalize_name(p.split("==")[0]) not in carried]
    problems, unverified = [f"{p}: not in {folder}" for p in missing], set()
    for key, (version, path) in carried.items():
        met = []
        for req in _requirements(path):
            if req.marker is not None and not req.marker.evaluate(env):
                continue  # an extra, or another platform's
            dep = canonicalize_name(req.name)
            if dep in carried:
                have, where = carried[dep][0], "carried"
            elif dep in IMAGE:
                have, where = IMAGE[dep], "image"
            else:
                problems.append(f"{os.path.basename(path)} requires {req}: neither in the image nor carried (add "
                                f"'{req.name}' to CARRY in benchmarks/gpu/carry.py, with a pin)")
                continue
            if have is None:
                unverified.add(f"{req.name} ({req.specifier or 'any'})")
                met.append(f"{req.name} (image)")
            elif req.specifier and not req.specifier.contains(Version(have), prereleases=True):
                problems.append(f"{os.path.basename(path)} requires {req}, the {where} has {req.name} {have}: choose "
                                f"the newest {key} whose Requires-Dist accepts {have} (OVERRIDE in carry.py)")
            else:
                met.append(f"{req.name} {have} ({where})")
        if key == "torchao":
            floor = _torchao_min_torch(path)
            if floor is None or Version(IMAGE["torch"]) < Version(floor):
                problems.append(f"{os.path.basename(path)} loads its kernels over torch >= {floor}; the image has "
                                f"torch {IMAGE['torch']}: choose a torchao built for it (OVERRIDE in carry.py)")
            else:
                met.append(f"torch {IMAGE['torch']} >= {floor} (its kernels load)")
        print(f"  {key} {version}: " + (", ".join(met) if met else "no requirements"))
    if unverified:
        print("  in the image, version not listed in KINDS.md (run_all.sh records it there): "
              + ", ".join(sorted(unverified)))
    for p in problems:
        print(f"carry.py check: {p}", file=sys.stderr)
    return 1 if problems else 0


def slim(folder: str) -> int:
    """Rewrite each wheel named in ``SLIM`` without the files its pattern matches (their RECORD lines too); a wheel
    already slimmed is left as it is."""
    for key, (version, path) in _wheels(folder).items():
        pattern = SLIM.get(key)
        if pattern is None:
            continue
        with zipfile.ZipFile(path) as z:
            members = z.infolist()
            drop = {m.filename for m in members if re.match(pattern, m.filename)}
            if not drop:
                continue
            before = os.path.getsize(path)
            tmp = path + ".tmp"
            with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as out:
                for m in members:
                    if m.filename in drop:
                        continue
                    data = z.read(m.filename)
                    if m.filename.endswith(".dist-info/RECORD"):
                        lines = data.decode().splitlines(keepends=True)
                        data = "".join(line for line in lines if line.split(",")[0] not in drop).encode()
                    out.writestr(m, data, compress_type=zipfile.ZIP_DEFLATED)
        os.replace(tmp, path)
        print(f"  {key} {version}: left out {len(drop)} files ({', '.join(sorted(os.path.basename(d) for d in drop))}):"
              f" {before / (1 << 20):.1f} -> {os.path.getsize(path) / (1 << 20):.1f} MiB")
    return 0


def _tree_bytes() -> tuple[int, int]:
    """(tracked files that exist, untracked files git does not ignore): what the device tool sends of the tree."""
    def files(*args):
        out = subprocess.run(["git", "-C", ROOT, "ls-files", "-z", *args], check=True, capture_output=True).stdout
        return [p for p in out.decode().split("\0") if p]

    def size(paths):
        return sum(os.path.getsize(os.path.join(ROOT, p)) for p in paths
                   if os.path.isfile(os.path.join(ROOT, p)) and not os.path.islink(os.path.join(ROOT, p)))

    return size(files()), size(files("-o", "--exclude-standard"))


def _dir_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs)


def size(folders: list[str], limit_mib: float) -> int:
    tracked, untracked = _tree_bytes()
    carried = {f: _dir_bytes(f) for f in folders}
    total = tracked + untracked + sum(carried.values())
    mib = 1 << 20
    parts = [f"tracked {tracked / mib:.1f}", f"untracked {untracked / mib:.1f}"]
    parts += [f"{os.path.relpath(f, ROOT)} {b / mib:.1f}" for f, b in carried.items()]
    print(f"travel size: {total / mib:.1f} MiB ({', '.join(parts)}; limit {limit_mib:g} MiB, the device tool's 64)")
    if total > limit_mib * mib:
        print(f"carry.py size: {total / mib:.1f} MiB would travel, over the {limit_mib:g} MiB allowed: carry fewer "
              f"wheels, or ignore large untracked files (.gitignore)", file=sys.stderr)
        return 1
    return 0


def env() -> int:
    """On the machine that runs the checks: the versions found and each carried package's requirements, as JSON."""
    import importlib.metadata as md
    import platform

    versions = {"python": platform.python_version()}
    for name in RECORD:
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            versions[name] = None
    unmet = []
    for name in CARRY:
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            try:
                have = md.version(req.name)
            except md.PackageNotFoundError:
                unmet.append(f"{name} requires {req}: not installed")
                continue
            if req.specifier and not req.specifier.contains(Version(have), prereleases=True):
                unmet.append(f"{name} requires {req}: {have} installed")
    print(json.dumps({"versions": versions, "unmet_requirements": unmet}))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("pins")
    c = sub.add_parser("check")
    c.add_argument("folder")
    c.add_argument("--python", default=IMAGE_VERSIONS["python"].rsplit(".", 1)[0], help="the target Python (X.Y)")
    sl = sub.add_parser("slim")
    sl.add_argument("folder")
    s = sub.add_parser("size")
    s.add_argument("folders", nargs="*")
    s.add_argument("--limit-mib", type=float, default=LIMIT_MIB)
    sub.add_parser("env")
    args = p.parse_args(argv)
    if args.cmd == "pins":
        print("\n".join(pins()))
        return 0
    if args.cmd == "check":
        return check(args.folder, args.python)
    if args.cmd == "slim":
        return slim(args.folder)
    if args.cmd == "size":
        return size([os.path.abspath(f) for f in args.folders], args.limit_mib)
    return env()


if __name__ == "__main__":
    sys.exit(main())
