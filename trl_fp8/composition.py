"""Where capabilities meet, read from what each declares (:class:`trl_fp8.capability.Capability`): the set-up order
(``after``), the settings and capabilities a run cannot combine (``conflicts``, ``excludes``), and which declaration
wins where two meet (``overrides``, applied by :func:`winner`): what serves the sampler (each capability's
``serves``, read once by :func:`trl_fp8.sampling.decide` before TRL builds anything), the in-process generation path
and the vLLM engine call. No imports of any capability — a new capability declares its joins in its own class; this
module reads a trainer only to resolve its offers at set-up and at each generation, and to describe the composition
at start.
"""

from __future__ import annotations

import contextlib


def setup_order(capabilities) -> tuple:
    """``capabilities`` in an order where each comes after every capability its ``after`` names (among those given;
    a name that is no capability at all is an error), otherwise in the order given. Raises ``ValueError`` on a
    cycle."""
    by_name = {cap.name: cap for cap in capabilities}
    if len(by_name) != len(capabilities):
        raise ValueError(f"two capabilities share a name: {[cap.name for cap in capabilities]}")
    for cap in capabilities:
        for name in (*cap.after, *cap.excludes, *cap.overrides):
            if name not in by_name:
                raise ValueError(f"{cap.__name__} names {name!r}, which is not a capability "
                                 f"({', '.join(sorted(by_name))}).")
    for cap in capabilities:
        for name in cap.overrides:
            if cap.name in by_name[name].overrides:
                raise ValueError(f"{cap.__name__} and {by_name[name].__name__} override each other (`overrides`): "
                                 "one offer must win; declare it on one of the two only.")
    ordered, placed, visiting = [], set(), []

    def place(cap) -> None:
        if cap.name in placed:
            return
        if cap.name in visiting:
            cycle = visiting[visiting.index(cap.name):] + [cap.name]
            raise ValueError(f"capability set-up order has a cycle: {' -> '.join(cycle)} (each names the next in "
                             "`after`).")
        visiting.append(cap.name)
        for name in cap.after:
            place(by_name[name])
        visiting.pop()
        placed.add(cap.name)
        ordered.append(cap)

    for cap in capabilities:
        place(cap)
    return tuple(ordered)


def check_conflicts(capabilities, args) -> None:
    """Refuse (``ValueError`` naming both sides) a run asking for a capability together with a setting it declares a
    conflict with, or with a capability it excludes. Called once, when a ``GRPOConfig`` is built."""
    wanted = [cap for cap in capabilities if cap.wanted(args)]
    names = {cap.name: cap for cap in wanted}
    for cap in wanted:
        for conflict in cap.conflicts:
            value = getattr(args, conflict.field, None)
            if value and (conflict.when is None or conflict.when(args)):
                raise ValueError(f"{cap.asked(args)} cannot be combined with {conflict.field}={value!r}: "
                                 f"{conflict.why}")
        for other, why in cap.excludes.items():
            if other in names:
                raise ValueError(f"{cap.asked(args)} cannot be combined with {names[other].asked(args)}: {why}")


def winner(offers: dict):
    """The one offer of ``{capability: offer}`` (None offers dropped) that no other offering capability overrides;
    None without offers. Two offers that neither overrides are an undeclared join: ``RuntimeError``."""
    offers = {cap: offer for cap, offer in offers.items() if offer is not None}
    if not offers:
        return None
    beaten = {name for cap in offers for name in cap.overrides}
    left = [offer for cap, offer in offers.items() if cap.name not in beaten]
    mutual = sorted(cap.name for cap in offers if any(cap.name in other.overrides and other.name in cap.overrides
                                                      for other in offers))
    if mutual:
        raise RuntimeError(f"capabilities {mutual} override each other: one offer must win; declare `overrides` on "
                           "one of them only.")
    if len(left) != 1:
        raise RuntimeError(f"capabilities {sorted(cap.name for cap in offers)} each offer the same thing and none "
                           "overrides the others: declare `overrides` on the one that wins.")
    return left[0]


def check_replacements(trainer) -> None:
    """The replacements of the generation path and of the vLLM engine call asked once at set-up, as they are made in
    training, so that two without a declared winner fail when the trainer is built, not at the first generation (who
    samples, and what it is sent, is the sampling decision's: :mod:`trl_fp8.sampling`)."""
    with _training(trainer):
        generation_path(trainer)
        vllm_generate(trainer)


@contextlib.contextmanager
def _training(trainer):
    """The model in training mode for the block (offers made only while training are asked at set-up)."""
    model = getattr(trainer, "model", None)
    was = getattr(model, "training", True)
    if model is not None and not was:
        model.train()
    try:
        yield
    finally:
        if model is not None and not was:
            model.eval()


def generation_path(trainer):
    """The function that replaces the in-process generation call, or None (TRL's path)."""
    return winner({type(c): c.generation_path(trainer) for c in trainer.capabilities.values()})


def vllm_generate(trainer):
    """The function that answers TRL's colocated vLLM engine call, or None (TRL's own call)."""
    return winner({type(c): c.vllm_generate(trainer) for c in trainer.capabilities.values()})


def describe(trainer) -> list[str]:
    """The resolved composition of a run, as the trainer prints it at start beside its sampling decision: the
    capabilities in set-up order, who observes every sync, and who answers the generation call. Read from the
    declarations, like the README's support table."""
    caps = list(trainer.capabilities.values())
    if not caps:
        return ["trl_fp8: no capability on; TRL's trainer as it is."]
    use_vllm = bool(getattr(trainer, "use_vllm", False))
    observers = [c.name for c in sync_observers(caps)]
    with _training(trainer):
        path = _offerer(caps, "generation_path", trainer)
        call = _offerer(caps, "vllm_generate", trainer) if use_vllm else None
    lines = [f"trl_fp8: capabilities in set-up order: {' -> '.join(c.name for c in caps)}",
             f"trl_fp8: observers of every sync: {', '.join(observers) or 'none'}"]
    if use_vllm:
        lines.append(f"trl_fp8: vLLM engine call: {call or 'TRL'}")
    else:
        lines.append(f"trl_fp8: in-process generation path: {path or 'TRL'}")
    return lines


def sync_observers(caps) -> list:
    """The capabilities that observe a sync (their own ``before_sync`` or ``after_sync``): only for them does the
    trainer wrap TRL's vLLM sync; a run whose capabilities observe none keeps TRL's sync as it is."""
    return [c for c in caps if type(c).before_sync is not _base_hook("before_sync")
            or type(c).after_sync is not _base_hook("after_sync")]


def _base_hook(name):
    from .capability import Capability

    return getattr(Capability, name)


def _offerer(caps, hook: str, trainer) -> str | None:
    offers = {type(c): (c.name if getattr(c, hook)(trainer) is not None else None) for c in caps}
    return winner(offers)
