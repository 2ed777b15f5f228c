"""trl_fp8.fast_qlora.layers: dense copies of the highest-error layers, speed mode, and undoing both."""

import pytest
import torch

from tests.fast_qlora.conftest import load_4bit_demo
from trl_fp8 import fourbit
from trl_fp8.fast_qlora.layers import PolicyEdits, find_blocks, rank_layers
from trl_fp8.fast_qlora.ranking import select_within_budget


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(ids).logits.float().log_softmax(-1).mean()
    out.backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_ranking_reports_every_4bit_lora_layer_with_its_dense_bytes():
    model = load_4bit_demo()
    ranking = rank_layers(fourbit.lora_layers(model))
    assert len(ranking) == 14
    q = next(c for c in ranking if c.name.endswith("layers.0.self_attn.q_proj"))
    assert q.dense_bytes == (64 * 64 + 64) * 4  # fp32 compute dtype, weight + bias
    assert all(0.05 < c.rel_error < 0.2 for c in ranking)  # NF4 on near-Gaussian weights: ~0.09


def test_kept_layers_compute_bit_for_bit_the_same_and_undo_restores_the_4bit_modules():
    model = load_4bit_demo()
    model.train()
    ids = torch.randint(2, 100, (2, 10))
    loss0, grads0 = _loss_and_grads(model, ids)
    layers = fourbit.lora_layers(model)
    originals = {name: layer.base_layer for name, layer in layers}
    ranking = rank_layers(layers)
    budget = sum(c.dense_bytes for c in ranking) // 2
    chosen = select_within_budget(ranking, budget)
    edits = PolicyEdits(model)
    edits.keep_dense(dict(layers), chosen)
    assert 0 < len(edits.kept) < 14 and edits.kept_bytes <= budget
    loss1, grads1 = _loss_and_grads(model, ids)
    assert torch.equal(loss0, loss1)
    assert grads0.keys() == grads1.keys()
    for name in grads0:
        assert torch.equal(grads0[name], grads1[name]), name
    dense = {id(layer.base_layer) for layer, _ in edits.kept}
    edits.undo()
    assert all(layer.base_layer is originals[name] for name, layer in layers)
    assert edits.kept_bytes == 0
    edits.keep_dense(dict(layers), chosen)  # a second train(): the very same dense modules come back
    assert {id(layer.base_layer) for layer, _ in edits.kept} == dense


def test_speed_mode_trains_the_top_blocks_and_backward_stops_below_them():
    model = load_4bit_demo()
    model.train()
    model.enable_input_require_grads()
    ids = torch.randint(2, 100, (2, 10))
    path, blocks = find_blocks(model)
    assert path.endswith("model.layers") and len(blocks) == 2
    with torch.no_grad():  # a fresh adapter below (B = 0): skipping it computes the same
        for n, p in blocks[0].named_parameters():
            if "lora_B" in n:
                p.zero_()
    _, full = _loss_and_grads(model, ids)
    embed_grads = []

    def watch(module, inputs, output):
        if output.requires_grad:
            output.register_hook(embed_grads.append)

    handle = model.get_input_embeddings().register_forward_hook(watch)
    edits = PolicyEdits(model)
    edits.train_top_blocks(1)
    assert edits.trained_blocks == (1, 2)
    _, cut = _loss_and_grads(model, ids)
    assert not embed_grads  # backward never reached the embeddings
    assert cut and all(".layers.1." in n for n in cut)  # only the top block trains
    for n, g in cut.items():
        torch.testing.assert_close(g, full[n], rtol=0, atol=0)  # the cut does not change the top block's gradients
    assert all("forward" in vars(m) for m in edits.skipped) and len(edits.skipped) == 7
    edits.undo()
    handle.remove()
    assert all(p.requires_grad for n, p in model.named_parameters() if "lora_" in n and ".default." in n)
    assert not any("forward" in vars(m) for _, m in fourbit.lora_layers(model))
    _, again = _loss_and_grads(model, ids)
    assert again.keys() == full.keys()


def test_speed_mode_keeps_a_pretrained_lower_adapter_frozen_but_applied():
    model = load_4bit_demo()  # B random: the lower blocks' delta is not zero
    model.eval()
    ids = torch.randint(2, 100, (2, 10))
    with torch.no_grad():
        before = model(ids).logits
    edits = PolicyEdits(model)
    edits.train_top_blocks(1)
    assert not edits.skipped
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, rtol=0, atol=0)
    assert not any(p.requires_grad for n, p in model.named_parameters() if ".layers.0." in n)


def test_speed_mode_with_more_blocks_than_the_model_has_trains_everything():
    model = load_4bit_demo()
    edits = PolicyEdits(model)
    edits.train_top_blocks(5)
    assert edits.trained_blocks == (0, 2) and not edits.frozen and edits.hook is None


def test_no_block_stack_is_a_clear_error():
    edits = PolicyEdits(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="qlora_adapter_layers"):
        edits.train_top_blocks(1)
