"""DUET's early stop inside a colocated vLLM engine: an own step loop over one ``n=1`` request per planned rollout,
with one :class:`~trl_fp8.duet.abort.RolloutMonitor` per request (no TRL imports; every vLLM call goes through
:mod:`trl_fp8._trl`).

Each request streams its new tokens (``RequestOutputKind.DELTA``) with the processed logprobs of the sampled token
and of the top two (what TRL's engine computes with ``logprobs_mode="processed_logprobs"``: after temperature and
top-k/top-p). Per token, as the in-process stopping criterion (:class:`~trl_fp8.duet.sampling.DuetStoppingCriteria`)
does: the sampled token's logprob is kept and summed (the surrogate's ``Σ log π``); an EOS token ends the rollout
without a monitor step; any other token steps the monitor with the top-1 minus top-2 probability margin and, every
``poll_every`` tokens, the decoded tail. When the monitor is done (confidence stop or abort) the rollout keeps the
``t`` tokens generated so far and its request is aborted between two steps; a token that still arrives for it (a
GPU engine may deliver one) is discarded. A request aborted inside ``LLM.generate`` would vanish without its partial
output, hence the own loop.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from .. import _trl
from .sampling import TAIL_TOKENS

_CALLS = itertools.count()  # request ids stay unique across calls on one engine


@dataclass
class EngineRollout:
    """One planned rollout's request and what it kept."""

    monitor: object  # RolloutMonitor (or anything with step(t, margin, tail) and done)
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # the sampled tokens' processed logprobs
    sum_logp: float = 0.0
    stop_at: int | None = None  # tokens kept by a DUET stop/abort
    closed: bool = False  # finished, stopped or aborted: anything arriving later is discarded
    discarded: int = 0  # tokens that arrived after the rollout was closed


def _margin(logprobs: dict) -> float:
    """Top-1 minus top-2 probability from one position's logprob entries (token -> Logprob with a 1-based rank)."""
    ranked = sorted((lp for lp in logprobs.values() if lp.rank is not None and lp.rank <= 2), key=lambda lp: lp.rank)
    probs = [math.exp(lp.logprob) if not math.isnan(lp.logprob) else 0.0 for lp in ranked] + [0.0, 0.0]
    return probs[0] - probs[1]


def engine_rollouts(llm, prompts: list[list[int]], monitors: list, params, tokenizer, eos_token_ids,
                    poll_every: int = 8) -> list[EngineRollout]:
    """Generate one rollout per prompt (repeat a prompt for several rollouts) on the colocated engine ``llm`` with
    ``params`` (one request each, ``n=1``, DELTA outputs with top-2 logprobs: :func:`trl_fp8._trl.vllm_delta_params`),
    ``monitors[i]`` deciding when rollout ``i`` stops. Returns the rollouts in prompt order."""
    if len(prompts) != len(monitors):
        raise ValueError(f"{len(prompts)} prompts for {len(monitors)} monitors.")
    eos = set(int(t) for t in eos_token_ids)
    call = next(_CALLS)
    ids = [f"trl_fp8-duet-{call}-{i}" for i in range(len(prompts))]
    rollouts = {rid: EngineRollout(monitor) for rid, monitor in zip(ids, monitors, strict=True)}
    open_ids = set()
    try:
        for rid, prompt in zip(ids, prompts, strict=True):
            _trl.vllm_add_request(llm, rid, prompt, params)
            open_ids.add(rid)
        while open_ids:
            to_abort = []
            for out in _trl.vllm_step(llm):
                rollout = rollouts.get(out.request_id)
                if rollout is None:
                    continue  # not one of ours
                delta = out.outputs[0]
                for k, token in enumerate(delta.token_ids):
                    if rollout.closed:
                        rollout.discarded += 1
                        continue
                    if _feed(rollout, int(token), delta.logprobs[k], eos, tokenizer, poll_every):
                        to_abort.append(out.request_id)
                if out.finished:
                    rollout.closed = True
                if rollout.closed:
                    open_ids.discard(out.request_id)
            _trl.vllm_abort(llm, to_abort)
    finally:
        _trl.vllm_abort(llm, sorted(open_ids))  # an error midway leaves nothing running on the engine
    return [rollouts[rid] for rid in ids]


def _feed(rollout: EngineRollout, token: int, logprobs: dict, eos: set, tokenizer, poll_every: int) -> bool:
    """One new token of ``rollout``; True when the monitor just stopped it (its request is to be aborted)."""
    lp = float(logprobs[token].logprob)
    rollout.completion_ids.append(token)
    rollout.logprobs.append(lp)
    rollout.sum_logp += lp
    t = len(rollout.completion_ids)
    if token in eos:  # the rollout ended by itself: no monitor step on EOS (as in-process)
        rollout.closed = True
        return False
    tail = None
    if t % poll_every == 0:
        tail = tokenizer.decode(rollout.completion_ids[-TAIL_TOKENS:], skip_special_tokens=True)
    rollout.monitor.step(t, _margin(logprobs), tail)
    if rollout.monitor.done:
        rollout.stop_at = t
        rollout.closed = True
        return True
    return False
