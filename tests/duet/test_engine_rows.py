"""DUET's engine step loop (trl_fp8.duet.vllm) against the in-process path, without vLLM: a replay engine streams,
request by request, exactly the tokens and processed logprobs the in-process generation drew, with vLLM's output
shapes (DELTA outputs, logprob entries with 1-based ranks). The same plan and the same draws must then give the same
rollouts, outcomes, importance weights and masks. The real engine is exercised in tests/duet/test_vllm.py."""

from types import SimpleNamespace

import pytest
import torch

import trl_fp8
from trl_fp8 import _trl
from trl_fp8.duet import sampling
from trl_fp8.duet.component import Duet
from trl_fp8.duet.markers import MarkerDetector
from trl_fp8.duet.vllm import engine_rollouts
from trl_fp8.app.tasks.arithmetic import correctness_reward, make_arithmetic_dataset

SLOTS = 4


class _Logprob(SimpleNamespace):
    pass


def _entries(logps: torch.Tensor, token: int) -> dict:
    """vLLM's logprob entries of one position with logprobs=2: the sampled token and the top two, ranked."""
    top = logps.topk(2).indices.tolist()
    rank = lambda t: 1 + int((logps > logps[t]).sum())  # noqa: E731
    return {t: _Logprob(logprob=float(logps[t]), rank=rank(t)) for t in dict.fromkeys([token, *top])}


class _ReplayEngine:
    """The j-th request added streams ``streams[j]`` (token, logprob entries), ``per_step`` tokens per step (2: as an
    engine that schedules ahead may deliver, so a token after the stop arrives in the same output), finishing at EOS
    or at the end of its stream; an aborted request delivers nothing more."""

    def __init__(self, streams, eos, per_step=1):
        self.streams, self.eos, self.per_step = streams, set(eos), per_step
        self.added, self.aborted, self.pos = [], [], {}

    def add_request(self, request_id, prompt, params):
        self.pos[request_id] = (self.streams[len(self.added)], 0)
        self.added.append((request_id, prompt["prompt_token_ids"], params))

    def step(self):
        outs = []
        for rid, (stream, k) in list(self.pos.items()):
            chunk = stream[k:k + self.per_step]
            ends = [j for j, (token, _) in enumerate(chunk) if token in self.eos]
            chunk = chunk[:ends[0] + 1] if ends else chunk
            finished = bool(ends) or k + len(chunk) == len(stream)
            if finished:
                del self.pos[rid]
            else:
                self.pos[rid] = (stream, k + len(chunk))
            outs.append(SimpleNamespace(request_id=rid, finished=finished, outputs=[SimpleNamespace(
                token_ids=[t for t, _ in chunk], logprobs=[e for _, e in chunk])]))
        return outs

    def abort_request(self, request_ids):
        for rid in request_ids:
            self.aborted.append(rid)
            self.pos.pop(rid, None)


class _Coins:
    def __init__(self, draws):
        self.draws = list(draws)

    def random(self):
        return self.draws.pop(0)


def _tune(monitors):
    """Small thresholds so that every path runs within 16 tokens: a marker (any vowel; one monitor in three never
    finds one) polled at token 8, the confidence trim after it, the no-marker abort or ε-keep at token 11."""
    for j, m in enumerate(monitors):
        m.k1, m.k2, m.grace, m.margin_threshold = 2, 6, 5, 0.0
        m.detector = MarkerDetector(["NEVER-SEEN"] if j % 3 == 2 else ["[aeiouAEIOU0-9]"])
    return monitors


@pytest.fixture
def recorder(monkeypatch):
    """Records, per call of the in-process stopping criterion, each row's sampled token and processed logprobs."""
    steps = []
    original = sampling.DuetStoppingCriteria.__call__

    def recording(self, input_ids, scores, **kwargs):
        steps.append((input_ids[:, -1].tolist(), torch.log_softmax(self.scores_tap.scores.float(), -1)))
        return original(self, input_ids, scores, **kwargs)

    monkeypatch.setattr(sampling.DuetStoppingCriteria, "__call__", recording)
    return steps


def _streams(steps):
    rows = len(steps[0][0])
    return [[(tokens[i], _entries(logps[i], tokens[i])) for tokens, logps in steps] for i in range(rows)]


def test_the_step_loop_keeps_what_the_in_process_criterion_keeps(tiny_model_dir, recorder):
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessorList, StoppingCriteriaList

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [tok(p)["input_ids"] for p in ["12+3=", "4+56=", "7+8=", "90+1=", "3+3=", "66+6="]]
    draws = [[0.5, 0.0], [0.01, 0.5], [0.5, 0.99], [0.5, 0.0], [0.5, 0.5], [0.5, 0.0]]  # trim skip, ε-keep among them

    def monitors():
        from trl_fp8.duet.abort import RolloutMonitor

        return _tune([RolloutMonitor(MarkerDetector(["x"]), 0, 0, _Coins(d)) for d in draws])

    ours = monitors()
    crit = sampling.DuetStoppingCriteria(ours, tok, eos_token_ids=[tok.eos_token_id])
    enc = tok.pad({"input_ids": prompts}, return_tensors="pt")
    torch.manual_seed(1)
    with torch.no_grad():
        out = model.generate(**enc, do_sample=True, max_new_tokens=16, pad_token_id=tok.pad_token_id,
                             eos_token_id=[tok.eos_token_id], logits_processor=LogitsProcessorList([crit.scores_tap]),
                             stopping_criteria=StoppingCriteriaList([crit]))
    generated = out[:, enc["input_ids"].shape[1]:].tolist()
    expected = []
    for ids, stop_at in zip(generated, crit.stop_at, strict=True):
        ids = ids[:stop_at] if stop_at is not None else ids
        expected.append(ids[:ids.index(tok.eos_token_id) + 1] if tok.eos_token_id in ids else ids)

    for per_step in (1, 2):
        streams = _streams(recorder)
        engine = _ReplayEngine(streams, [tok.eos_token_id], per_step=per_step)
        theirs = monitors()
        rollouts = engine_rollouts(SimpleNamespace(llm_engine=engine), prompts, theirs, "params", tok,
                                   [tok.eos_token_id])
        assert [p for _, p, _ in engine.added] == prompts and {p for _, _, p in engine.added} == {"params"}
        assert [r.completion_ids for r in rollouts] == expected
        assert [r.stop_at for r in rollouts] == crit.stop_at
        for r, mine, other in zip(rollouts, ours, theirs, strict=True):
            assert (mine.aborted, mine.stopped, mine.eps_kept, mine.has_marker) == \
                (other.aborted, other.stopped, other.eps_kept, other.has_marker)
            assert len(r.logprobs) == len(r.completion_ids) and sum(r.logprobs) == pytest.approx(r.sum_logp)
        assert torch.allclose(torch.tensor([r.sum_logp for r in rollouts], dtype=torch.float64), crit.sum_logps,
                              atol=1e-4)
        assert any(m.aborted for m in theirs) and any(m.stopped for m in theirs)  # both early-stop paths ran
        stopped = [(rid, r) for (rid, _, _), r in zip(engine.added, rollouts, strict=True) if r.stop_at is not None]
        assert sorted(engine.aborted) == sorted(rid for rid, _ in stopped)  # aborted at the stop, nothing else
        # a token delivered after the stop, in the same output, is discarded (never with one token per step)
        late = sum(min(r.stop_at + r.stop_at % 2, len(streams[0])) - r.stop_at for _, r in stopped)
        assert sum(r.discarded for r in rollouts) == (late if per_step == 2 else 0)
        assert per_step == 1 or late > 0
        assert not engine.pos  # nothing left running on the engine


def _trainer(tmp_path, model_dir):
    args = trl_fp8.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", max_steps=1,
                              per_device_train_batch_size=12, num_generations=SLOTS, max_completion_length=16,
                              duet=True, duet_budget=0.5, seed=11, gradient_checkpointing=False,
                              duet_screen=0)  # one pass per sampler: the replay compares one plan
    trainer = trl_fp8.GRPOTrainer(model=model_dir, reward_funcs=[correctness_reward], args=args,
                                  train_dataset=make_arithmetic_dataset(16, seed=0))
    trainer.model.train()
    return trainer


def _duet(trainer):
    duet = Duet()
    duet.setup(trainer)  # a fresh controller: the same seed, the same plan and coins
    plan = duet.controller.plan
    duet.controller.plan = lambda keys: (lambda p: (_tune(p.monitors), p)[1])(plan(keys))
    duet.controller.stats.lookup = _skewed(duet.controller.stats.lookup)
    return duet


def _skewed(lookup):
    """Cold prompts with different informativeness, so that the plan gives them different rollout counts."""
    def skewed(keys):
        s, lengths, n, reprobe = lookup(keys)
        return torch.linspace(0.2, 3.0, len(keys), dtype=s.dtype), lengths, n, reprobe
    return skewed


def test_same_plan_same_outcomes_same_weights_and_masks(tmp_path, tiny_model_dir, recorder, monkeypatch):
    trainer = _trainer(tmp_path, tiny_model_dir)
    tok = trainer._tokenizer
    prompt_ids = [ids for p in ["12+3=", "4+56=", "7+8="] for ids in [tok(p)["input_ids"]] * SLOTS]

    in_process = _duet(trainer)
    torch.manual_seed(2)
    ids_a, logps_a = in_process.generate(trainer, prompt_ids, None, {}, SLOTS)
    batch_a = in_process.batch
    counts = batch_a["plan"].counts.tolist()
    assert len(set(counts)) > 1 and sum(counts) < len(prompt_ids)  # per-prompt counts, placeholders elsewhere

    engine = _ReplayEngine(_streams(recorder), trainer.eos_token_ids)
    trainer.vllm_generation = SimpleNamespace(llm=SimpleNamespace(llm_engine=engine))
    monkeypatch.setattr(_trl, "vllm_sampling_kwargs", lambda generation: {})
    monkeypatch.setattr(_trl, "vllm_delta_params", lambda kwargs, logprobs: ("params", logprobs))
    on_engine = _duet(trainer)
    ids_b, logps_b = on_engine.generate_vllm(trainer, prompt_ids, None, SLOTS)
    batch_b = on_engine.batch

    assert logps_a is None and ids_b == ids_a
    assert len(engine.added) == sum(counts)  # one request per planned rollout, none for the placeholders
    assert {p for *_, p in engine.added} == {("params", 2)}
    assert batch_b["rows"] == batch_a["rows"] and batch_b["lengths"] == batch_a["lengths"]
    assert torch.allclose(batch_b["sum_logps"], batch_a["sum_logps"], atol=1e-4)
    monitors_a, monitors_b = batch_a["plan"].monitors, batch_b["plan"].monitors
    assert [(m.aborted, m.eps_kept) for m in monitors_b] == [(m.aborted, m.eps_kept) for m in monitors_a]
    assert any(m.aborted for m in monitors_b)
    real = set(batch_b["rows"])
    for row, (ids, lps) in enumerate(zip(ids_b, logps_b, strict=True)):
        if row in real:
            assert len(lps) == len(ids) and all(isinstance(lp, float) for lp in lps)
        else:  # a placeholder: one token, no sampling logprob (TRL: NaN, no correction)
            assert ids == [trainer.eos_token_ids[0]] and lps == [None]

    results = []
    for duet in (in_process, on_engine):
        rewards = duet.adjust_rewards(trainer, torch.arange(len(prompt_ids), dtype=torch.float32).unsqueeze(1))
        torch.manual_seed(3)
        output = {"advantages": torch.randn(len(prompt_ids)),
                  "completion_mask": torch.ones(len(prompt_ids), 16, dtype=torch.long)}
        output = duet.adjust_batch(trainer, output)
        results.append((rewards, output, duet.last_weights))
    (rewards_a, out_a, weights_a), (rewards_b, out_b, weights_b) = results
    assert torch.equal(rewards_a.isnan(), rewards_b.isnan())
    assert torch.equal(out_a["advantages"], out_b["advantages"])
    assert torch.equal(out_a["completion_mask"], out_b["completion_mask"])
    assert weights_a == weights_b
    aborted_rows = [r for r, m in zip(batch_b["rows"], monitors_b, strict=True) if m.aborted]
    assert out_b["completion_mask"][aborted_rows].sum() == 0 and torch.all(out_b["advantages"][aborted_rows] == 0)
    assert (out_b["completion_mask"].sum(1) > 0).sum() == sum(not m.aborted for m in monitors_b)


@pytest.mark.parametrize("overrides, message", [
    ({"vllm_mode": "server"}, r"duet=True with use_vllm=True needs vllm_mode='colocate' \(got vllm_mode='server'\)"
                              r".*Colocate mode is supported"),
    ({"vllm_tensor_parallel_size": 2}, "needs vllm_tensor_parallel_size=1"),
    ({"vllm_enable_sleep_mode": True}, "cannot run with vllm_enable_sleep_mode=True"),
])
def test_duet_with_vllm_refuses_what_it_cannot_step(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        trl_fp8.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, duet=True, use_vllm=True, **overrides)


def test_duet_with_vllm_colocate_is_accepted(tmp_path):
    args = trl_fp8.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, duet=True, use_vllm=True, vllm_mode="colocate")
    assert args.duet and args.use_vllm
