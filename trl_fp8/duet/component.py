"""DUET as a trainer capability: config fields, the generation plan (only the planned rollouts are generated, with
the early-stop rule), placeholders excluded from rewards and loss, importance weights on the advantages, and the
``duet/*`` metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import inspect
import logging

import torch

from .. import _trl, distributed
from ..capability import Capability, Conflict, check_fraction, check_int, check_number
from .controller import ALLOCATORS, DuetController
from .markers import compile_markers
from .passrate import total_rewards
from .sampling import DuetStoppingCriteria
from .vllm import engine_rollouts
from . import declaration
from .declaration import DuetArgs  # noqa: F401 (re-exported)

logger = logging.getLogger("trl_fp8.duet")



def prompt_key(ids) -> str:
    """DUET's key of a prompt: a hash of its token ids (the statistics are kept per key)."""
    return hashlib.sha1(repr([int(t) for t in ids]).encode()).hexdigest()


PAPER_CAP = 3072  # the reference's completion cap; its length knobs below are scaled from it
PAPER_GRACE, PAPER_MIN_TOKENS, PAPER_POLL, PAPER_K_GAP = 150, 200, 8, 50


def scaled(value: int | None, paper: int, max_completion_length: int, minimum: int) -> int:
    """``value`` when set, else the reference's ``paper`` tokens at its 3072-token cap scaled to
    ``max_completion_length`` (at least ``minimum``)."""
    if value is not None:
        return value
    return max(minimum, round(paper * max_completion_length / PAPER_CAP))


def abort_grace(grace: int | None, max_completion_length: int) -> int:
    """Tokens past K2 before a marker-less rollout is aborted: ``grace`` when set, else the reference's 150 tokens
    at a 3072-token cap scaled to ``max_completion_length`` (at least 8 tokens, one marker poll)."""
    return scaled(grace, PAPER_GRACE, max_completion_length, 8)


def length_knobs(args, max_completion_length: int) -> dict:
    """The abort rule's lengths for this run, each in proportion to ``max_completion_length`` unless set: grace
    after K2 (>= 8), minimum length before any stop (K1 >= it; >= 0), the gap K2 - K1 (>= 1) and the marker poll
    period (>= 1)."""
    return {
        "grace": abort_grace(args.duet_abort_grace, max_completion_length),
        "min_tokens": scaled(args.duet_abort_min_tokens, PAPER_MIN_TOKENS, max_completion_length, 0),
        "k_gap": scaled(None, PAPER_K_GAP, max_completion_length, 1),
        "poll_every": scaled(args.duet_poll_every, PAPER_POLL, max_completion_length, 1),
    }


class Duet(Capability):
    name = "duet"
    Args = DuetArgs
    state_file = "duet_state.pt"
    state_required = False  # checkpoints of earlier trl_fp8 versions have none: the controller then starts afresh
    # every DUET field shapes the controller's state and the plan: a resume must match all of them (derived from the
    # fields, so a new field cannot be forgotten here)
    resume_fields = tuple(f.name for f in dataclasses.fields(DuetArgs))
    conflicts = (Conflict("use_transformers_continuous_batching", "DUET plans and stops each rollout on the "
                          "default transformers generation path (or a colocated vLLM engine)."),)
    layouts = {
        "ddp": None,  # one plan for the global batch, identical on every rank (see generate)
        "deepspeed": {  # ZeRO-1/2 keep the parameters whole: generation involves no collective
            1: None, 2: None,
            3: "each rank generates a different number of rollouts, and under ZeRO-3 generation is a collective "
               "(every rank must run the same forward passes)",
        },
        "fsdp": "each rank generates a different number of rollouts, and under FSDP generation is a collective",
    }
    off_hint = "duet=False"
    drops_masked_rows = True  # placeholders and aborted rollouts: no loss pass on them (where that is exact)

    @classmethod
    def wanted(cls, args) -> bool:
        return declaration.wanted(args)

    @staticmethod
    def validate(args) -> None:
        if not isinstance(args.duet, bool):
            raise ValueError(f"duet must be True or False, got {args.duet!r}.")
        check_fraction("duet_budget", args.duet_budget)
        if isinstance(args.duet_n_min, int) and not isinstance(args.duet_n_min, bool) and args.duet_n_min == 1:
            raise ValueError("duet_n_min=1 is not allowed: GRPO's advantages are relative to the prompt's group, so a "
                             "prompt with one rollout gets advantage 0 and teaches nothing. Use duet_n_min >= 2 (a "
                             "prompt then gets 0 or at least duet_n_min rollouts; the default is 2).")
        check_int("duet_n_min", args.duet_n_min, 2)
        check_int("duet_n_max", args.duet_n_max, 2, allow_none=True)
        check_int("duet_abort_grace", args.duet_abort_grace, 0, allow_none=True)
        check_int("duet_abort_min_tokens", args.duet_abort_min_tokens, 0, allow_none=True)
        check_int("duet_poll_every", args.duet_poll_every, 1, allow_none=True)
        check_int("duet_screen", args.duet_screen, 0)
        if args.duet_screen == 1:
            raise ValueError("duet_screen=1 is not allowed: one rollout's reward cannot show whether a prompt's "
                             "outcomes differ. Use 0 (no screening) or >= 2 (the default is 2).")
        check_fraction("duet_screen_keep_prob", args.duet_screen_keep_prob)
        check_int("duet_refill_tries", args.duet_refill_tries, 0)
        if args.duet_allocator not in ALLOCATORS:
            raise ValueError(f"duet_allocator must be one of {', '.join(repr(a) for a in ALLOCATORS)}, got "
                             f"{args.duet_allocator!r}.")
        if isinstance(args.duet_pass_threshold, bool) or not isinstance(args.duet_pass_threshold, (int, float)) \
                or args.duet_pass_threshold != args.duet_pass_threshold or abs(args.duet_pass_threshold) == float("inf"):
            raise ValueError(f"duet_pass_threshold must be a finite number (the total reward at which a rollout "
                             f"passes), got {args.duet_pass_threshold!r}.")
        check_fraction("duet_pass_decay", args.duet_pass_decay)
        if args.duet_n_max is not None and args.duet_n_max > args.num_generations:
            raise ValueError(f"duet_n_max={args.duet_n_max} exceeds num_generations={args.num_generations} (the "
                             "slots per prompt).")
        n_max = args.duet_n_max if args.duet_n_max is not None else args.num_generations
        if args.duet_n_min > n_max:
            raise ValueError(f"duet_n_min={args.duet_n_min} must be <= duet_n_max={n_max}.")
        compile_markers(args.duet_markers)
        check_fraction("duet_abort_keep_prob", args.duet_abort_keep_prob)
        check_fraction("duet_min_propensity", args.duet_min_propensity)
        check_number("duet_max_weight", args.duet_max_weight, 1)
        check_number("duet_prior_strength", args.duet_prior_strength, 0, finite=True,
                     note=" (pseudo-groups; 0 = no shrinkage)")
        if not args.duet:
            return
        if args.use_vllm:  # DUET steps the engine itself (trl_fp8.duet.vllm): it must live in this process
            if args.vllm_mode != "colocate":
                raise ValueError(f"duet=True with use_vllm=True needs vllm_mode='colocate' (got vllm_mode="
                                 f"{args.vllm_mode!r}): DUET stops rollouts inside the engine by stepping it itself, "
                                 "and a server's engine runs in another process. Colocate mode is supported.")
            if args.vllm_tensor_parallel_size != 1:
                raise ValueError(f"duet=True with use_vllm=True needs vllm_tensor_parallel_size=1 (got "
                                 f"{args.vllm_tensor_parallel_size}): each rank generates its own planned rollouts.")
            if args.vllm_enable_sleep_mode:
                raise ValueError("duet=True with use_vllm=True cannot run with vllm_enable_sleep_mode=True yet.")
        beams = (args.generation_kwargs or {}).get("num_beams", 1) if isinstance(args.generation_kwargs, dict) else 1
        if beams and beams > 1:
            raise ValueError(f"duet=True stops sampled rollouts one by one; it cannot run with beam search "
                             f"(generation_kwargs num_beams={beams}).")

    def setup(self, trainer) -> bool:
        if trainer.tools or trainer.rollout_func is not None or trainer.environment_factories is not None:
            raise ValueError("duet=True does not support tools, rollout_func or environments yet.")
        a = trainer.args
        screen = a.duet_screen
        if screen and any(isinstance(f, torch.nn.Module) for f in trainer.reward_funcs):
            logger.info("duet_screen: a reward model is among the reward functions; screening scores rollouts "
                        "inside the generation step with reward functions only, so it is off for this run.")
            screen = 0
        self.refill_tries = a.duet_refill_tries
        if self.refill_tries:
            data = trainer.train_dataset
            if data is None or not (hasattr(data, "__len__") and hasattr(data, "__getitem__")) or not len(data):
                raise ValueError(f"duet_refill_tries={self.refill_tries} draws substitute prompts from the training "
                                 f"set by index: it needs a non-empty map-style train_dataset (a datasets.Dataset or "
                                 f"a list), got {type(data).__name__}. Set duet_refill_tries=0 for an iterable one.")
        self.controller = DuetController(
            budget=a.duet_budget, slots=trainer.num_generations, n_min=a.duet_n_min, n_max=a.duet_n_max,
            markers=a.duet_markers, keep_prob=a.duet_abort_keep_prob, min_propensity=a.duet_min_propensity,
            max_weight=a.duet_max_weight, seed=a.seed, default_length=float(trainer.max_completion_length),
            prior_strength=a.duet_prior_strength, screen=screen, screen_keep_prob=a.duet_screen_keep_prob,
            allocator=a.duet_allocator, pass_threshold=a.duet_pass_threshold, pass_decay=a.duet_pass_decay,
            **length_knobs(a, trainer.max_completion_length),
        )
        self.batch = None
        self.last_weights = None  # the latest batch's importance weights (global, and this rank's slice)
        return True

    def held_tensors(self) -> dict:
        """None on the device: the controller's statistics are Python numbers (see :mod:`trl_fp8.duet.memory`)."""
        return {"duet/state": []}

    # -- checkpoints: a resumed run plans as the uninterrupted one would ------------------------------------------
    def state_dict(self) -> dict:
        return {"format": 1, "controller": self.controller.state_dict()}

    def boundary_state(self):
        """:meth:`state_dict` at a step boundary, deferred (:mod:`trl_fp8.checkpoints.boundary`): a function giving
        the state as it is now, at a cost proportional to what changes before it is called, not to the 100k prompts
        the tables may hold (:meth:`DuetController.mark`)."""
        controller = self.controller.mark()
        return lambda: {"format": 1, "controller": controller()}

    def load_state_dict(self, state: dict) -> None:
        self.controller.load_state_dict(state["controller"])

    # -- the step's prompts: idle ones replaced (duet_refill_tries) ----------------------------------------------
    def adjust_inputs(self, trainer, inputs: list) -> list:
        """With ``duet_refill_tries``, the batch's idle prompts replaced by other prompts of the training set
        (:meth:`DuetController.refill`): every slot row of a replaced group becomes the substitute's dataset row, so
        TRL tokenizes, generates and scores the substitute as if the sampler had drawn it. The decision is made for
        the global batch on every rank alike (the prompt keys are gathered: a collective every rank reaches); each
        rank then replaces its own groups."""
        if not self.refill_tries or not trainer.model.training:
            return inputs
        slots = trainer.num_generations
        if len(inputs) % slots:
            raise ValueError(f"DUET expects whole groups of {slots} slots, got {len(inputs)} rows.")

        def key_of(row) -> str:
            return prompt_key(trainer._tokenize_prompts([row["prompt"]])[0][0])

        local = [key_of(inputs[g * slots]) for g in range(len(inputs) // slots)]
        everyone = distributed.gather_objects(local)
        first = sum(len(part) for part in everyone[:distributed.rank()])
        keys = [k for part in everyone for k in part]
        data = trainer.train_dataset

        def draw(rng):
            row = data[rng.randrange(len(data))]
            return row, key_of(row)

        substitutes, idle = self.controller.refill(keys, draw, self.refill_tries)
        out = list(inputs)
        for q, row in substitutes.items():
            if first <= q < first + len(local):
                g = q - first
                out[g * slots:(g + 1) * slots] = [dict(row) for _ in range(slots)]
        _trl.record_metric(trainer, "duet/idle_prompts_frac", idle / len(keys))
        _trl.record_metric(trainer, "duet/refilled_frac", len(substitutes) / len(keys))
        return out

    # -- generation: DUET replaces the path --------------------------------------------------------------------
    def generation_path(self, trainer):
        return functools.partial(self.generate, trainer) if trainer.model.training else None

    def vllm_generate(self, trainer):
        return functools.partial(self.generate_vllm, trainer) if trainer.model.training else None

    def generate(self, trainer, prompt_ids, images, multimodal_fields, num_generations, model=None, *,
                 stopping_criteria=()):
        """Generate only the planned rollouts (with the early-stop rule) through TRL's own transformers path, with
        ``model`` (e.g. Fair Cast's twin) instead of the learner when given, honouring the other capabilities'
        ``stopping_criteria`` (e.g. the time budget's SIGTERM stop ends the generation in flight). See
        :meth:`planned_generation`."""
        if images is not None or multimodal_fields:
            raise ValueError("duet=True supports text prompts only.")

        def rows(prompts, monitors):
            criterion = DuetStoppingCriteria(monitors, trainer._tokenizer, trainer.eos_token_ids,
                                             poll_every=self.controller.poll_every)
            with _trl.generating_with(trainer, model, [criterion.scores_tap], [*stopping_criteria, criterion]):
                generated, _ = _trl.trl_generate(trainer, prompts, images, multimodal_fields, num_generations)
            out = [(ids[:stop_at] if stop_at is not None else ids, float(criterion.sum_logps[j]), None)
                   for j, (ids, stop_at) in enumerate(zip(generated, criterion.stop_at, strict=True))]
            # cut: another capability's criterion ended the generation (a row neither ended, stopped nor full)
            cut = any(not criterion.finished[j] and criterion.stop_at[j] is None
                      and len(ids) < trainer.max_completion_length for j, ids in enumerate(generated))
            return out, cut

        completion_ids, _ = self.planned_generation(trainer, prompt_ids, num_generations, rows, logprobs=False)
        return completion_ids, None

    def generate_vllm(self, trainer, prompt_ids, images, num_generations):
        """Generate only the planned rollouts on TRL's colocated vLLM engine (already synced by TRL): one ``n=1``
        request per planned rollout with TRL's sampling settings, stopped inside the engine by the early-stop rule
        (:func:`trl_fp8.duet.vllm.engine_rollouts`). Returns ``(completion_ids, logprobs)``: each kept token's
        processed sampling logprob, and None for a placeholder's token (no importance-sampling correction there; its
        loss mask is zeroed anyway). See :meth:`planned_generation`."""
        if images is not None and any(image is not None for image in images):
            raise ValueError("duet=True supports text prompts only.")
        generation = trainer.vllm_generation
        params = _trl.vllm_delta_params(_trl.vllm_sampling_kwargs(generation), logprobs=2)

        def rows(prompts, monitors):
            rollouts = engine_rollouts(generation.llm, prompts, monitors, params, trainer._tokenizer,
                                       trainer.eos_token_ids, poll_every=self.controller.poll_every)
            return [(r.completion_ids, r.sum_logp, r.logprobs) for r in rollouts], False

        return self.planned_generation(trainer, prompt_ids, num_generations, rows, logprobs=True)

    def planned_generation(self, trainer, prompt_ids, slots, rows, logprobs: bool):
        """Plan the batch, generate this rank's planned rollouts with ``rows(prompts, monitors) -> ([(completion_ids,
        Σ log π, per-token logprobs or None)], cut)`` (``cut``: another capability's stopping criterion ended the
        generation, e.g. on SIGTERM: nothing more is generated this step), fill unplanned slots with a 1-token placeholder (reward None, loss
        mask 0: see :meth:`adjust_rewards`, :meth:`adjust_batch`), record the outcomes and the ``duet/*`` metrics.
        Returns ``(completion_ids, logprobs)`` for this rank's slots (with ``logprobs``: per token, a placeholder's
        one token None; else None).

        Screening (``duet_screen``): the screened prompts' screens are generated with the rest of the first plan,
        scored with the trainer's reward functions (:meth:`_screen_uniform`), and the rollouts the controller then
        adds (:meth:`DuetController.after_screen`) are generated in a second pass.

        With many processes (DDP) the plan is made for the *global* batch (every rank's prompts, gathered in rank
        order as TRL gathers rewards), identically on every rank; each rank generates its own planned rows, and the
        outcomes (lengths, aborts, Σ log π, screen rewards) are gathered so every rank learns and weights the same
        way."""
        everyone = distributed.gather_objects([list(p) for p in prompt_ids])  # [prompt_ids] on one process
        start = sum(len(part) for part in everyone[:distributed.rank()])
        stop = start + len(prompt_ids)
        all_ids = [p for part in everyone for p in part]
        if len(all_ids) % slots:
            raise ValueError(f"DUET expects whole groups of {slots} slots, got {len(all_ids)} prompts.")
        groups = len(all_ids) // slots
        keys = [prompt_key(all_ids[g * slots]) for g in range(groups)]
        full_length = self.controller.stats.cold_length()
        plan = self.controller.plan(keys)
        results: dict[int, tuple] = {}  # this rank's global rows -> (completion_ids, Σ log π, token logprobs)
        outcomes: dict[int, tuple] = {}  # every rank's global rows -> (length, aborted, ε-kept, Σ log π)

        def run(global_rows: list[int]) -> bool:
            by_row = dict(zip(plan.real_rows(), plan.monitors, strict=True))
            mine = [r for r in global_rows if start <= r < stop]
            generated, cut = rows([all_ids[r] for r in mine], [by_row[r] for r in mine]) if mine else ([], False)
            local = []
            for r, (ids, sum_logp, lps) in zip(mine, generated, strict=True):
                results[r] = (ids, sum_logp, lps)
                local.append((r, len(ids), by_row[r].aborted, by_row[r].eps_kept, sum_logp))
            any_cut = False
            for part_cut, part in distributed.gather_objects((cut, local)):  # every rank's outcomes: the global batch
                any_cut |= part_cut
                for r, length, aborted, eps_kept, sum_logp in part:
                    outcomes[r] = (length, aborted, eps_kept, sum_logp)
                    by_row[r].aborted, by_row[r].eps_kept = aborted, eps_kept
            return any_cut

        cut = run(plan.real_rows())
        screened = int(plan.screened.sum()) if plan.screened is not None else 0
        if screened and not cut:  # a cut step is abandoned by the trainer's stop point: no second pass
            uniform = self._screen_uniform(trainer, plan, results, outcomes, start, stop)
            run(self.controller.after_screen(plan, uniform))
        planned = plan.real_rows()  # global rows, final
        placeholder = [trainer.eos_token_ids[0]]
        completion_ids = [placeholder] * len(prompt_ids)
        token_logps = [[None]] * len(prompt_ids) if logprobs else None
        for r, (ids, _, lps) in results.items():
            completion_ids[r - start] = ids
            if logprobs:
                token_logps[r - start] = lps
        lengths = [outcomes[r][0] for r in planned]
        sum_logps = torch.tensor([outcomes[r][3] for r in planned], dtype=torch.float64)
        self.batch = {"plan": plan, "rows": planned, "lengths": lengths, "sum_logps": sum_logps, "start": start,
                      "stop": stop}
        aborted = sum(m.aborted for m in plan.monitors)
        counts = plan.counts.double()
        metrics = {  # of the global batch: the same on every rank, recorded once
            "duet/tokens": float(sum(lengths)),
            "duet/tokens_saved_frac": 1.0 - sum(lengths) / (len(all_ids) * full_length),
            "duet/abort_frac": aborted / max(1, len(planned)),
            "duet/rollouts_per_prompt/mean": counts.mean().item(),
            "duet/rollouts_per_prompt/min": counts.min().item(),
            "duet/rollouts_per_prompt/max": counts.max().item(),
            "duet/prompts_without_rollouts_frac": (plan.counts == 0).double().mean().item(),
            "duet/screened_frac": screened / groups,
        }
        if screened:
            metrics["duet/screen_uniform_frac"] = sum(plan.screen_uniform) / screened
        if plan.lam != float("inf"):
            metrics["duet/lambda"] = plan.lam
        for name, value in metrics.items():
            _trl.record_metric(trainer, name, value)
        return completion_ids, token_logps

    def _screen_uniform(self, trainer, plan, results, outcomes, start: int, stop: int) -> list[bool | None]:
        """Per screened prompt: True when its kept screen rollouts all got one total reward (the trainer's reward
        functions, weighted and summed as TRL sums them), False when they differ, None when fewer than 2 were kept.
        Each rank scores its own rows (it holds their dataset rows); the rewards are gathered."""
        slots = plan.slots
        idx = plan.screened.nonzero().flatten().tolist()
        if getattr(trainer, "_generation_inputs", None) is None:  # called outside a training batch: no rows to
            return [None] * len(idx)  # score with, every screen continues (as without screening)
        screen_rows = [q * slots + j for q in idx for j in range(int(plan.counts[q]))]
        mine = [r for r in screen_rows if r in results and not outcomes[r][1]]
        rewards = self._score(trainer, [r - start for r in mine], [results[r][0] for r in mine]) if mine else []
        by_row = {}
        for part in distributed.gather_objects(list(zip(mine, rewards))):
            by_row.update(dict(part))
        uniform = []
        for q in idx:
            values = [by_row[q * slots + j] for j in range(int(plan.counts[q])) if q * slots + j in by_row]
            uniform.append(None if len(values) < 2 else max(values) - min(values) <= 1e-12)
        return uniform

    @staticmethod
    def _score(trainer, local_rows: list[int], completion_ids: list[list[int]]) -> list[float]:
        """The total reward of completions of this rank's slots ``local_rows``: each reward function called as TRL
        calls it (prompts, completions decoded as TRL decodes them, completion ids, the dataset columns, the trainer
        state), None counted as 0 and the functions weighted and summed as TRL does (``nansum``). Reward functions
        that log (``log_metric``, ``log_extra``) are given no-ops here: their logs come from TRL's own call."""
        inputs = trainer._generation_inputs
        sub = [inputs[i] for i in local_rows]
        prompts = [x["prompt"] for x in sub]
        texts = trainer.processing_class.batch_decode(completion_ids, skip_special_tokens=True)
        conversational = isinstance(prompts[0], list)
        completions = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
        columns = {k: [x[k] for x in sub] for k in sub[0] if k not in ("prompt", "completion", "completion_ids")}
        total = torch.zeros(len(sub), dtype=torch.float64)
        weights = trainer.reward_weights.tolist()
        for func, weight in zip(trainer.reward_funcs, weights, strict=True):
            out = func(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns,
                       trainer_state=trainer.state, log_extra=lambda *a, **k: None, log_metric=lambda *a, **k: None)
            if inspect.isawaitable(out):
                out = asyncio.run(out)
            values = torch.tensor([float("nan") if v is None else float(v) for v in out], dtype=torch.float64)
            total += torch.nan_to_num(values * weight, nan=0.0)
        return total.tolist()

    # -- batch ---------------------------------------------------------------------------------------------------
    def _excluded_rows(self, total: int) -> torch.Tensor:
        """Placeholder slots and aborted rollouts: no reward statistics, no gradient."""
        excluded = torch.ones(total, dtype=torch.bool)
        for r, monitor in zip(self.batch["rows"], self.batch["plan"].monitors, strict=True):
            excluded[r] = monitor.aborted
        return excluded

    def adjust_rewards(self, trainer, rewards: torch.Tensor) -> torch.Tensor:
        if self.batch is not None and trainer.model.training:
            rewards[self._excluded_rows(rewards.size(0)).to(rewards.device)] = torch.nan
            if self.controller.allocator == "pass_rate":  # the only reader: other runs keep no pass-rate state
                # each row's total reward, as TRL sums it (global rows: TRL gathered them); NaN where no reward
                # function applied (all None), which the pass rates then leave out rather than count as a fail
                total = total_rewards(rewards, trainer.reward_weights)
                self.batch["rewards"] = total.detach().double().cpu()
        return rewards

    def adjust_batch(self, trainer, output: dict) -> dict:
        if self.batch is None or not trainer.model.training:
            self.batch = None
            return output
        plan, rows = self.batch["plan"], self.batch["rows"]
        start, stop = self.batch["start"], self.batch["stop"]
        advantages = output["advantages"]  # this rank's slice of the global batch (TRL's process_slice)
        parts = distributed.gather_objects(advantages.detach().cpu().double().tolist())
        global_advantages = torch.tensor([a for part in parts for a in part], dtype=torch.float64)
        excluded = self._excluded_rows(global_advantages.numel())
        rewards = self.batch.get("rewards")
        self.controller.observe(plan, self.batch["lengths"], global_advantages[rows], self.batch["sum_logps"],
                                rewards=rewards[rows] if rewards is not None else None)
        groups = zero = 0  # generated groups (>= 2 kept rollouts) whose rewards all agreed: advantage 0 throughout
        for g, n in enumerate(plan.counts.tolist()):
            kept = [g * plan.slots + j for j in range(n) if not excluded[g * plan.slots + j]]
            if len(kept) >= 2:
                groups += 1
                zero += bool((global_advantages[kept] == 0).all())
        if groups:
            _trl.record_metric(trainer, "duet/zero_std_groups_frac", zero / groups)
        weights = torch.zeros(global_advantages.numel(), dtype=torch.float64)
        weights[rows] = self.controller.weights(plan).double()
        local = weights[start:stop].to(advantages.dtype).to(advantages.device)
        self.last_weights = {"counts": plan.counts.tolist(), "global": weights.tolist(), "local": local.tolist(),
                             "start": start, "stop": stop}
        output["advantages"] = advantages * local
        output["completion_mask"] = output["completion_mask"] * (~excluded[start:stop]).unsqueeze(1).to(
            output["completion_mask"].dtype).to(output["completion_mask"].device)
        _trl.recount_items(trainer, output)  # placeholders and aborted rollouts out of the loss's token count too
        self.batch = None
        return output
