"""The lifecycle every trl_fp8 capability follows, and the hooks the trainer calls at fixed points.

A capability is one object in its own package (Fair Cast, MXFP8, the weight-sync checks, DUET, ...) that owns its
state and its touch points. :class:`trl_fp8.GRPOTrainer` holds the ordered list of those a run asks for and calls
them; every hook has a do-nothing default, so a capability implements only what it contributes:

- config: ``Args`` (a dataclass mixin of its ``GRPOConfig`` fields) and ``validate(args)`` (config time: a
  ``ValueError`` naming the field and what is allowed); ``wanted(args)``: whether a run asks for it;
- ``setup(trainer)``: once, in list order, after TRL's own ``__init__``; returns False when, on this run, the
  capability has nothing to do (it is then dropped, having said why);
- generation (the in-process path): ``generating(trainer)`` (a context around each generation call),
  ``after_generation(trainer, completion_ids)``;
- the sampler: ``serves(args, facts)`` declares the kind it would serve; :func:`trl_fp8.sampling.decide` picks one
  kind and its owner before TRL builds anything; after set-up the trainer asks that owner alone for its
  ``offer(trainer)`` (a :class:`SamplerOffer`: stream, dtype, sampler, model, numerics) and installs it with the
  kind's handler (:mod:`trl_fp8.kinds`); ``sampler_ready(trainer, offer)`` once it is; ``before_sync`` /
  ``after_sync`` around every sync (the weight-sync checks observe them);
- batch and loss: ``adjust_inputs(trainer, inputs)`` (the generation batch's dataset rows, before TRL reads them),
  ``adjust_rewards(trainer, rewards)``, ``adjust_batch(trainer, output)``,
  ``on_policy_logps(trainer, inputs, logps)`` (the loss forward's per-token logprobs);
- tensors: ``describe(model)`` (the :class:`~trl_fp8.numerics.TensorSpec` of each tensor it changes the numerics
  of, read from the modules);
- checkpoints: ``state_dict()`` / ``load_state_dict(state)``, stored in the checkpoint as ``state_file`` (a resume
  restores it exactly; ``state_required = False``: a checkpoint without it starts the capability afresh), and
  ``resume_fields``: the config fields that shape its state, which a resume must match (see
  :mod:`trl_fp8.checkpoints`);
- metrics: recorded with :func:`trl_fp8._trl.record_metric` into TRL's own per-mode metrics;
- many processes: ``layouts`` (per process layout, None: supported, or why it is refused) and ``off_hint`` (the setting that
  turns it off), applied at config time and at trainer start by :func:`trl_fp8.distributed.admit`.

Where capabilities meet is declared data, read in one place (:mod:`trl_fp8.composition`), not code in the trainer:

- ``after``: the capabilities whose set-up this one builds on; the set-up order is derived from it (and a cycle or an
  unknown name is an error at import);
- ``conflicts``: the settings it cannot run with (:class:`Conflict`: a field and why), and ``excludes``: the other
  capabilities it cannot run with — checked once, when a ``GRPOConfig`` is built, naming both sides;
- ``serves(args, facts)`` declares what kind of sampler it would serve (:mod:`trl_fp8.sampling` decides once, from
  the config and the model facts, before TRL builds the engine); the owner's ``offer(trainer)`` then supplies the
  sampler and its stream; ``generation_path(trainer)`` and ``vllm_generate(trainer)`` replace the in-process
  generation call and the vLLM engine call; ``overrides`` names the capabilities whose declaration or replacement
  this one's wins over when both make one (two without a declared winner are an error).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch


def check_choice(field_name: str, value, allowed) -> None:
    """Raise a ``ValueError`` naming ``field_name`` and the allowed values unless ``value`` is one of them."""
    if value not in allowed:
        allowed_text = ", ".join(repr(a) for a in allowed)
        raise ValueError(f"{field_name}={value!r} is not valid; allowed values: {allowed_text}.")


def check_int(field_name: str, value, minimum: int, allow_none: bool = False) -> None:
    """Raise a ``ValueError`` naming ``field_name`` unless ``value`` is an integer >= ``minimum`` (or None)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        extra = " or None" if allow_none else ""
        raise ValueError(f"{field_name} must be an integer >= {minimum}{extra}, got {value!r}.")


def check_number(field_name: str, value, minimum: float, finite: bool = False, note: str = "") -> None:
    """Raise a ``ValueError`` naming ``field_name`` unless ``value`` is a real number (not a bool) >= ``minimum``
    (and not infinite when ``finite``); ``note`` follows the bound in the message."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= minimum or \
            (finite and value == float("inf")):
        raise ValueError(f"{field_name} must be {'a finite number ' if finite else ''}>= {minimum:g}{note}, "
                         f"got {value!r}.")


def check_fraction(field_name: str, value) -> None:
    """Raise a ``ValueError`` naming ``field_name`` unless ``0 < value <= 1``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"{field_name} must be in (0, 1], got {value!r}.")


@dataclass(frozen=True)
class Conflict:
    """A ``GRPOConfig`` setting a capability cannot run with: ``field`` set (truthy), optionally only ``when`` the
    capability's own settings say so (e.g. ``fast_qlora='on'``, not ``'auto'``); ``why`` completes the error."""

    field: str
    why: str
    when: Callable | None = None


@dataclass
class SamplerOffer:
    """Who generates the rollouts and what a sync sends it: the offer of the capability the sampling decision names
    as owner (:meth:`Capability.offer`), asked once after every capability set up. The trainer installs it with the
    decision's kind handler (:mod:`trl_fp8.kinds`) and runs every sync of it with the capabilities as observers
    (:meth:`Capability.before_sync` / :meth:`Capability.after_sync`). No capability installs a stream of its own or
    looks up who else offers.

    - ``stream``: ``() -> iterable of (learner name, tensor in dtype)``, what a sync sends (None: TRL's own stream);
    - ``dtype``: the dtype of what is sent (the sampler computes in it);
    - ``sampler``: the :class:`~trl_fp8.samplers.Sampler` the rollouts come from, as the checks read it back (an
      in-process twin a sync writes to, a rollout cache no sync feeds, a vLLM engine's LoRA slots); None with vLLM:
      the engine as TRL built it (the checks read its weights), or in-process: the learner itself;
    - ``model``: the in-process model to generate with instead of the learner (synced first when ``sampler.synced``),
      or None;
    - ``numerics``: ``() -> context manager`` yielding a model that computes the way the sampler computes, from the
      learner's current weights (the logprob check's reference ρ), or None (the learner cast to the sampler's dtype);
    - ``learner_values``: ``(name) -> tensor | None``, the value the learner's loss computes with for a streamed name,
      read from its parameters rather than the stream, in ``dtype`` (the weight-sync checks' ``quant_parity``
      compares the sampler with it), or None;
    - ``vllm_stream``: for a dense stream to vLLM, the callable TRL's sync iterates (``(vLLM name, tensor)``), set
      in place of TRL's own by the trainer's installer for that kind; None: ``stream`` as it is;
    - ``kind``: the kind of :mod:`trl_fp8.sampling` this offer serves (set by the trainer from the decision);
    - ``owner``: the capability's name (set by the trainer).
    """

    stream: Callable | None = None
    dtype: torch.dtype | None = None
    sampler: object = None
    model: torch.nn.Module | None = None
    numerics: Callable | None = None
    learner_values: Callable | None = None
    vllm_stream: Callable | None = None
    kind: str = ""
    owner: str = ""


# What a capability's generation_path (which replaces the in-process generation call) must still honour: the
# keyword arguments the trainer passes it, each gathered from every capability's hook of that name.
GENERATION_PATH_HONOURS = ("stopping_criteria",)


class StopNow(Exception):
    """Raised by the trainer when a capability's :meth:`Capability.stop_now` asks to stop the step in flight."""


class Capability:
    name: str = ""
    Args: type | None = None  # the GRPOConfig fields of this capability (a dataclass mixin)
    state_file: str | None = None  # file in a checkpoint folder holding state_dict(), if it has state
    state_required: bool = True  # False: resuming from a checkpoint without state_file starts it afresh
    resume_fields: tuple[str, ...] = ()  # config fields a resumed run must share with the checkpoint
    # A step stopped mid-way (SIGTERM, time budget) saves the last complete step: "boundary" = this capability's
    # state as it was at that step's end (recorded at each step's start, see trl_fp8.checkpoints.boundary);
    # "current" = as it is at the stop (state a cut step does not move, or too large to copy every step)
    state_at_stop: str = "boundary"
    # Many processes: "ddp" / "deepspeed" / "fsdp" -> None (supported) or why it is refused (a dict per ZeRO stage /
    # FSDP version where they differ); a layout left out is refused. One process is always supported.
    layouts: dict = {}
    off_hint: str = ""  # the setting that turns the capability off, for refusals (e.g. "fair_cast='off'")
    soft_default = None  # (args) -> truthy when on by default and not asked for: refused, it says so and stays off
    # Composition (see the module docstring): read by trl_fp8.composition, never by the trainer directly.
    after: tuple[str, ...] = ()  # capabilities whose set-up this one builds on
    conflicts: tuple[Conflict, ...] = ()  # settings it cannot run with
    excludes: dict[str, str] = {}  # other capability -> why the two cannot run together
    overrides: tuple[str, ...] = ()  # capabilities whose offers (sampler, generation path) this one's replaces
    derived_stream: bool = False  # its offer's stream computes what it sends at each sync (not held anyway)

    @classmethod
    def asked(cls, args) -> str:
        """How the run asked for it, for messages (e.g. ``fair_cast='stochastic'``)."""
        return f"{cls.name}={getattr(args, cls.name, None)!r}"

    @classmethod
    def serves(cls, args, facts) -> str | None:
        """What this capability, when wanted, would have the rollouts generated with and sent: a kind of
        :mod:`trl_fp8.sampling` (``"dense_stream"``, ``"lora_versions"``, ``"twin"``, ``"rollout_cache"``), or None.
        ``facts``: :class:`trl_fp8.sampling.ModelFacts` (LoRA or full, 4-bit or not), known before TRL builds
        anything. A declaration read by :func:`trl_fp8.sampling.decide` only (the winner by ``overrides``); the
        capability that wins makes the matching :meth:`offer` at set-up."""
        return None

    @classmethod
    def wanted(cls, args) -> bool:
        return False

    @classmethod
    def adapt_precision(cls, args, resolved: str) -> str | None:
        """Config time, after ``precision`` resolved to ``"bf16"`` / ``"fp16"`` / ``"fp32"``: adjust this capability's
        own fields to it; a note for the precision log line (what was changed), or None."""
        return None

    @staticmethod
    def validate(args) -> None:
        """Config-time validation of this capability's fields (and its combinations with TRL's)."""

    def setup(self, trainer) -> bool:
        return True

    # -- generation ----------------------------------------------------------------------------------------------
    def generating(self, trainer):
        return contextlib.nullcontext()

    def stopping_criteria(self, trainer) -> list:
        """Extra ``StoppingCriteria`` for the in-process generation (transformers' ``generate``)."""
        return []

    def after_generation(self, trainer, completion_ids) -> None:
        pass

    def stop_now(self, trainer) -> bool:
        """Asked on every process at the same points — each micro-batch's start and right after each generation —
        so it may run a collective: True stops the optimizer step in flight (:class:`StopNow`); the trainer then
        saves the last complete step's checkpoint and ``train()`` returns."""
        return False

    def offer(self, trainer) -> SamplerOffer | None:
        """What this capability offers to generate the rollouts with and to send the sampler (a
        :class:`SamplerOffer`), or None. Asked once, after every capability set up, and only of the owner the
        sampling decision names; the trainer installs it (see :class:`SamplerOffer`). It reads what to offer from
        ``trainer.sampling.kind``."""
        return None

    def generation_path(self, trainer):
        """A function replacing the in-process generation call — ``(prompt_ids, images, multimodal_fields,
        num_generations, model, *, stopping_criteria) -> (completion_ids, logprobs)`` — or None (TRL's path, with the
        hooks above).

        What a replacing path must still honour (:data:`GENERATION_PATH_HONOURS`): ``stopping_criteria``, every
        capability's :meth:`stopping_criteria` (e.g. the time budget's SIGTERM stop, which cuts the generation in
        flight), to be passed to every ``generate`` call it makes. While it runs, the trainer's
        ``_generation_inputs`` holds the batch's dataset rows (slot-aligned with ``prompt_ids``), e.g. to score a
        screening group."""
        return None

    def vllm_generate(self, trainer):
        """A function answering TRL's colocated vLLM engine call (after TRL's own sync), or None."""
        return None

    # -- the sampler, once chosen: observers of every sync -------------------------------------------------------
    def sampler_ready(self, trainer, offer: SamplerOffer | None) -> bool:
        """Once, after the trainer installed the decision's sampler offer (``offer``; None: TRL's own sampler and
        stream): e.g. the weight-sync checks build their sampler and learner sides here. False: nothing to do on this
        run (the capability is dropped, having said why)."""
        return True

    def before_sync(self, trainer, step: int) -> None:
        """Before every sync of the sampler (the trainer's in-process sync, or TRL's vLLM sync)."""

    def after_sync(self, trainer, step: int, log) -> None:
        """After every sync; ``log`` (:class:`trl_fp8.samplers.SyncLog`) holds what was streamed."""

    # -- batch and loss ------------------------------------------------------------------------------------------
    # True: this capability masks whole rows out of the loss (DUET's placeholders): the trainer then leaves rows
    # with an all-zero loss mask out of the loss's forward and backward where that is exact (_trl.drop_masked_rows)
    drops_masked_rows = False

    def adjust_inputs(self, trainer, inputs: list) -> list:
        """The generation batch's dataset rows before TRL reads them (slot-aligned groups of ``num_generations``
        rows); a capability may replace rows (e.g. DUET's refill). Returns the rows to use (a new list)."""
        return inputs

    def adjust_rewards(self, trainer, rewards: torch.Tensor) -> torch.Tensor:
        return rewards

    def adjust_batch(self, trainer, output: dict) -> dict:
        return output

    def on_policy_logps(self, trainer, inputs: dict, logps: torch.Tensor) -> None:
        pass

    # -- tensors and state ---------------------------------------------------------------------------------------
    def describe(self, model: torch.nn.Module) -> dict:
        return {}

    def state_dict(self) -> dict | None:
        return None

    def load_state_dict(self, state: dict) -> None:
        pass

    def save_process_files(self, trainer, folder: str) -> None:
        """Files *every* process writes into the checkpoint being staged in ``folder`` (e.g. per-rank shard state),
        before its completion marker; ``state_dict`` is written by the main process only."""

    # -- memory: what it allocates (the plan) and what it holds (the measure) --------------------------------------
    @classmethod
    def memory_rows(cls, spec) -> list:
        """What this capability allocates in a run, as :class:`trl_fp8.plan.Row` s (bytes, per parameter of what,
        when alive, the :meth:`held_tensors` category each is checked against), from the plan's
        :class:`trl_fp8.plan.PlanSpec`: arithmetic, no tensors. Called by :func:`trl_fp8.plan.memory_plan` when
        :meth:`wanted`. Default: ``memory_rows(spec)`` of the ``memory`` module in the capability's own package
        (e.g. ``trl_fp8/fair_cast/memory.py``), none if it has no such module."""
        import importlib
        import importlib.util

        package = cls.__module__.rpartition(".")[0]
        if not package or importlib.util.find_spec(f"{package}.memory") is None:
            return []
        return list(importlib.import_module(f"{package}.memory").memory_rows(spec))

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this capability allocated and holds after set-up, by category (the ``category`` of its
        :meth:`memory_rows`), for :func:`trl_fp8.plan.measure`: its own copies and buffers — not the model's
        parameters, gradients or optimizer state, nor another capability's tensors (the measure counts each storage
        once, capabilities first). Default: none."""
        return {}

    def load_process_files(self, trainer, folder: str) -> None:
        """On every process, after ``load_state_dict``: ``folder`` is the checkpoint being resumed, where the files of
        :meth:`save_process_files` are read from (never from where the checkpoint was first written: it may have
        been moved)."""
