"""Sampler views: the in-process transformers model, and a vLLM server seen through its client (stand-in)."""

import pytest
import torch

from trl_fp8 import numerics
from trl_fp8.samplers import SyncLog, TransformersSampler, VLLMServerSampler, effective_columns, probe_columns
from trl_fp8.sync_checks.monitor import LearnerSide, SyncMonitor


@pytest.fixture
def tied_model(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True)
    return Qwen2ForCausalLM(config).to(torch.bfloat16).eval()


def test_effective_columns_read_a_linear_weight_exactly():
    layer = torch.nn.Linear(16, 8, bias=False).to(torch.bfloat16)
    cols = probe_columns(16, 5, step=3)
    assert torch.equal(cols, probe_columns(16, 5, step=3)) and not torch.equal(cols, probe_columns(16, 5, step=4))
    read = effective_columns(layer, 16, cols, torch.bfloat16, "cpu")
    assert torch.equal(read, layer.weight.data[:, cols])


def test_transformers_sampler_reads_loads_versions_and_builds_cold_copies(tied_model):
    sampler = TransformersSampler(tied_model)
    manifest = sampler.manifest()
    assert "lm_head.weight" not in manifest  # tied: served once, under the embedding's name
    name = "model.layers.0.mlp.down_proj.weight"
    assert manifest[name] == ((32, 64), torch.bfloat16)
    new = torch.randn(32, 64).to(torch.bfloat16)
    sampler.load([(name, new)])
    assert torch.equal(sampler.read(name), new)
    with pytest.raises(KeyError, match="no parameter 'nope'"):
        sampler.load([("nope", new)])
    assert sampler.version() is None
    sampler.set_version(7)
    assert sampler.version() == 7
    cold = sampler.cold({name: new + 1})
    assert torch.equal(cold.read(name), new + 1) and torch.equal(sampler.read(name), new)
    assert sampler.recipe()[name] == numerics.dense(torch.bfloat16)


def test_transformers_sampler_scores_given_sequences(tied_model):
    sampler = TransformersSampler(tied_model)
    prompts, completions = [[1, 2, 3], [4, 5]], [[6, 7], []]
    scored = sampler.sequence_logprobs(prompts, completions, temperature=0.5)
    with torch.no_grad():
        logits = tied_model(input_ids=torch.tensor([[1, 2, 3, 6, 7]])).logits[0, 2:4].float() / 0.5
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor([[6], [7]])).squeeze(1)
    torch.testing.assert_close(torch.tensor(scored[0]), expected, rtol=0, atol=1e-6)
    assert scored[1] == []
    with pytest.raises(NotImplementedError, match="vllm-server sampler cannot score"):
        VLLMServerSampler(_Client(), {}).sequence_logprobs([[1]], [[2]])


def test_a_tied_output_layer_in_process_has_nothing_to_probe(tied_model):
    # the same Parameter: nothing can be stale in-process (vLLM's repacked copies are probed: test_vllm_engine.py)
    assert TransformersSampler(tied_model).alias_reads(0) == {}


class _Client:
    def __init__(self, dtype="bfloat16"):
        self.dtype, self.resets = dtype, 0

    def get_server_info(self):
        return {"model_config": {"dtype": self.dtype}}

    def reset_prefix_cache(self):
        self.resets += 1


def test_server_sampler_checks_what_the_client_sees():
    learner = {"a.weight": torch.zeros(2, 2, dtype=torch.bfloat16), "b.weight": torch.zeros(3, dtype=torch.bfloat16)}
    side = LearnerSide(lambda: learner.items(), {n: numerics.dense(torch.bfloat16) for n in learner})
    client = _Client("float32")
    sampler = VLLMServerSampler(client, {n: tuple(t.shape) for n, t in learner.items()})
    monitor = SyncMonitor("all", sampler, side)
    assert set(monitor.checks) == {"recipe_parity", "coverage", "logprob_agreement", "cache_hygiene"}
    assert sampler.reset_cache() is None and client.resets == 1
    import trl_fp8

    log = SyncLog()
    list(log.tap([("a.weight", learner["a.weight"])]))  # b.weight never sent
    with pytest.raises(trl_fp8.WeightSyncError, match="dtype learner='bfloat16' sampler='float32'"):
        monitor.after_sync(0, log)
    client.dtype = "bfloat16"
    monitor = SyncMonitor(["coverage"], sampler, side)
    with pytest.raises(trl_fp8.WeightSyncError, match=r"\[coverage\] not sent: b.weight"):
        monitor.after_sync(0, log)
