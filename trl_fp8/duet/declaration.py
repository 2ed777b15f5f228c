"""What DUET declares, read alike by the trainer (:mod:`.component`) and the memory plan (``trl-fp8 plan``):
its ``GRPOConfig`` fields with their defaults, when it is wanted. Pure Python: importable without torch or TRL."""

from __future__ import annotations

from dataclasses import dataclass, field

AFTER = ()
OVERRIDES = ()
DERIVED_STREAM = False


@dataclass
class DuetArgs:
    duet: bool = field(
        default=False,
        metadata={"help": "trl_fp8: DUET per-step token budget (rollouts per prompt and marker-gated early stop)."},
    )
    duet_budget: float = field(
        default=0.5,
        metadata={"help": "trl_fp8: DUET budget β in (0, 1], as a fraction of the full GRPO token budget."},
    )
    duet_n_min: int = field(
        default=2,
        metadata={"help": "trl_fp8: DUET smallest group a prompt is given (>= 2; a prompt gets 0 or duet_n_min.."
                  "duet_n_max rollouts: a lone rollout has a group-relative advantage of 0 and teaches nothing)."},
    )
    duet_n_max: int | None = field(
        default=None,
        metadata={"help": "trl_fp8: DUET maximum rollouts per prompt; default and upper bound: num_generations."},
    )
    duet_markers: list[str] = field(
        default_factory=lambda: ["math"],
        metadata={"help": "trl_fp8: DUET answer markers: preset names ('math', 'code', 'qa') and/or regexes."},
    )
    duet_abort_keep_prob: float = field(
        default=0.05,
        metadata={"help": "trl_fp8: DUET probability of keeping (weight 1/p) a marker-less rollout instead of "
                  "aborting it; also the probability of skipping the confidence trim."},
    )
    duet_min_propensity: float = field(
        default=0.05, metadata={"help": "trl_fp8: DUET floor of the per-prompt allocation propensity, in (0, 1]."}
    )
    duet_max_weight: float = field(
        default=1000.0, metadata={"help": "trl_fp8: DUET cap of the importance weight (>= 1)."}
    )
    duet_prior_strength: float = field(
        default=0.0,
        metadata={"help": "trl_fp8: DUET shrinkage of a prompt's informativeness towards the mean over all observed "
                  "groups, in pseudo-groups (>= 0; 0: none). With k > 0 one zero-variance group no longer keeps a "
                  "prompt from rollouts, and cold prompts get the observed mean instead of 1.0."},
    )
    duet_abort_grace: int | None = field(
        default=None,
        metadata={"help": "trl_fp8: DUET tokens past K2 before a marker-less rollout is aborted; default (None): "
                  "the paper's 150 tokens at a 3072-token cap, scaled to max_completion_length (at least 8)."},
    )
    duet_abort_min_tokens: int | None = field(
        default=None,
        metadata={"help": "trl_fp8: DUET length before which no rollout is stopped or aborted (K1 >= it); default "
                  "(None): the reference's 200 tokens at a 3072-token cap, scaled to max_completion_length."},
    )
    duet_poll_every: int | None = field(
        default=None,
        metadata={"help": "trl_fp8: DUET tokens between two looks for an answer marker; default (None): the "
                  "reference's 8 tokens at a 3072-token cap, scaled to max_completion_length (at least 1)."},
    )
    duet_screen: int = field(
        default=2,
        metadata={"help": "trl_fp8: DUET cold start: a prompt never seen before first gets a screening group of "
                  "this many rollouts, and the rest of its rollouts only if their rewards differ (else with "
                  "probability duet_screen_keep_prob, weighted by its inverse); 0: off (cold prompts are "
                  "allocated uniformly). 0 or >= 2."},
    )
    duet_screen_keep_prob: float = field(
        default=0.1,
        metadata={"help": "trl_fp8: DUET probability that a cold prompt whose screening group got one reward still "
                  "gets the rest of its rollouts (then weighted 1/p, which keeps the gradient unbiased), in (0, 1]."},
    )
    duet_refill_tries: int = field(
        default=0,
        metadata={"help": "trl_fp8: DUET refill: a prompt of the step whose every observed group had one reward (and "
                  "that is not due for a re-probe) is replaced by another prompt of the training set, the first of "
                  "up to this many random draws that is neither in the step nor idle itself, so the step's budget "
                  "goes to prompts with something to teach (as DAPO's dynamic sampling). 0: off. Needs a map-style "
                  "train_dataset."},
    )
    duet_allocator: str = field(
        default="informativeness",
        metadata={"help": "trl_fp8: DUET allocator: 'informativeness' (Neyman allocation on the spread of "
                  "advantage x log-probability, the paper's) or 'pass_rate' (a Beta posterior of each prompt's pass "
                  "rate, aged by duet_pass_decay; prompts are filled up to duet_n_max in order of the probability "
                  "that such a group shows reward variance, per token). See docs/duet.md."},
    )
    duet_pass_threshold: float = field(
        default=0.5,
        metadata={"help": "trl_fp8: DUET pass_rate allocator: a rollout passes when its total reward (the reward "
                  "functions weighted and summed, as TRL sums them) is at least this."},
    )
    duet_pass_decay: float = field(
        default=0.5,
        metadata={"help": "trl_fp8: DUET pass_rate allocator: each time a prompt comes up again, its past passes "
                  "and fails are multiplied by this, in (0, 1] (1: no ageing)."},
    )


def wanted(args) -> bool:
    return bool(getattr(args, "duet", False))
