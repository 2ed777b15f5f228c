"""The in-process sampler's logprobs recorded during generate() equal a forward pass over the result."""

import math

import torch
from transformers import LogitsProcessorList

from trl_fp8.sync_checks.logprobs import SampledLogprobTap


def test_tap_records_the_logprob_of_every_sampled_token(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    prompt = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    tap = SampledLogprobTap(temperature=0.7)
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=True, temperature=0.7,
                             top_k=0, top_p=1.0, max_new_tokens=9, logits_processor=LogitsProcessorList([tap]),
                             eos_token_id=None, pad_token_id=0)
    completions = out[:, 4:].tolist()
    completions[1] = completions[1][:5]  # as if row 1 had stopped at its EOS after 5 tokens
    recorded = tap.per_row(completions)
    assert [len(r) for r in recorded] == [9, 5]
    with torch.no_grad():
        logits = model(out).logits[:, 3:-1].float() / 0.7
    expected = torch.log_softmax(logits, -1).gather(2, out[:, 4:, None]).squeeze(2)
    torch.testing.assert_close(torch.tensor(recorded[0]), expected[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.tensor(recorded[1]), expected[1, :5], rtol=0, atol=1e-5)


def test_tap_without_a_generation_gives_empty_rows():
    assert SampledLogprobTap().per_row([[1, 2], []]) == [[], []]


def test_tap_rejects_a_bad_temperature():
    import pytest

    with pytest.raises(ValueError, match="temperature must be > 0"):
        SampledLogprobTap(0.0)


def test_tap_table_is_the_rows_padded_with_zeros():
    tap = SampledLogprobTap()
    tap(torch.tensor([[5], [5]]), torch.log(torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.2, 0.7]])))
    tap(torch.tensor([[5, 2], [5, 0]]), torch.log(torch.tensor([[0.2, 0.2, 0.6], [0.3, 0.3, 0.4]])))
    table = tap.table([[2, 1], [0]])  # the second row stopped after its first token
    assert table.shape == (2, 2)
    assert torch.allclose(table, torch.tensor([[math.log(0.25), math.log(0.2)], [math.log(0.1), 0.0]]), atol=1e-6)


def test_tap_reduces_in_batches_with_the_same_result_as_step_by_step():
    torch.manual_seed(0)
    steps = [torch.randn(3, 11) for _ in range(7)]
    tokens = torch.randint(0, 11, (3, 7))
    completions = [tokens[0].tolist(), tokens[1, :4].tolist(), []]  # row 1 stopped after 4 tokens, row 2 at once
    tables = []
    for budget in (1, 3 * 11 * 4 * 2, SampledLogprobTap.BUFFER_BYTES):  # every step, every 2-3 steps, all at the end
        tap = SampledLogprobTap(temperature=0.5)
        tap.BUFFER_BYTES = budget
        ids = torch.zeros(3, 2, dtype=torch.long)
        for k, logits in enumerate(steps):
            tap(ids, logits)
            ids = torch.cat([ids, tokens[:, k:k + 1]], dim=1)
        tables.append(tap.table(completions))
    expected = torch.log_softmax(torch.stack(steps, 1) / 0.5, -1).gather(2, tokens[..., None]).squeeze(2)
    expected[1, 4:] = 0.0
    expected[2] = 0.0
    for table in tables:
        torch.testing.assert_close(table, expected, rtol=0, atol=1e-6)


def test_tap_with_rows_other_than_the_completions_refuses_with_a_value_error():
    import pytest

    tap = SampledLogprobTap()
    tap(torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, 5))
    with pytest.raises(ValueError, match="recorded 2 rows for 3 completions"):
        tap.table([[1], [1], [1]])


def test_tap_as_a_forward_hook_records_what_the_processor_path_records(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    prompt = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    tables, outs = [], []
    for how in ("hook", "hook reduced every step", "processor"):
        tap = SampledLogprobTap(temperature=0.7)
        if how == "hook reduced every step":
            tap.BUFFER_BYTES = 1
        hooked = how.startswith("hook")
        torch.manual_seed(0)
        handle = model.register_forward_hook(tap.forward_hook, with_kwargs=True) if hooked else None
        with torch.no_grad():
            outs.append(model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=True,
                                       temperature=0.7, top_k=0, top_p=1.0, max_new_tokens=7, eos_token_id=None,
                                       pad_token_id=0,
                                       logits_processor=LogitsProcessorList([] if hooked else [tap])))
        if handle is not None:
            handle.remove()
        completions = outs[-1][:, 4:].tolist()
        completions[1] = completions[1][:3]  # as if row 1 had stopped at its EOS after 3 tokens
        tables.append(tap.table(completions))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    torch.testing.assert_close(tables[1], tables[0], rtol=0, atol=0)
    torch.testing.assert_close(tables[2], tables[0], rtol=0, atol=1e-6)
    with torch.no_grad():
        logits = model(outs[0]).logits[:, 3:-1].float() / 0.7
    expected = torch.log_softmax(logits, -1).gather(2, outs[0][:, 4:, None]).squeeze(2)
    expected[1, 3:] = 0.0
    torch.testing.assert_close(tables[0], expected, rtol=0, atol=1e-5)
