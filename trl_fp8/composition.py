"""Where capabilities meet, read from what each declares (:class:`trl_fp8.capability.Capability`): the set-up order
(``after``), the settings and capabilities a run cannot combine (``conflicts``, ``excludes``), and which offer wins
when two offer a serving stream or a generation model (``overrides``). Pure: no trainer state, no imports of any
capability — a new capability declares its joins in its own class.
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
    if len(left) != 1:
        raise RuntimeError(f"capabilities {sorted(cap.name for cap in offers)} each offer the same thing and none "
                           "overrides the others: declare `overrides` on the one that wins.")
    return left[0]


def serving(trainer):
    """What the sampler is sent instead of TRL's stream (:class:`~trl_fp8.capability.Serving`), or None."""
    return winner({type(c): c.serving(trainer) for c in trainer.capabilities.values()})


def generation_model(trainer):
    """The in-process model to generate with instead of the learner, or None."""
    return winner({type(c): c.generation_model(trainer) for c in trainer.capabilities.values()})


def generation_path(trainer):
    """The function that replaces the in-process generation call, or None (TRL's path)."""
    return winner({type(c): c.generation_path(trainer) for c in trainer.capabilities.values()})


def vllm_generate(trainer):
    """The function that answers TRL's colocated vLLM engine call, or None (TRL's own call)."""
    return winner({type(c): c.vllm_generate(trainer) for c in trainer.capabilities.values()})


@contextlib.contextmanager
def engine_contexts(capabilities, args):
    """Every capability's :meth:`~trl_fp8.capability.Capability.engine_context` for this config, entered in order."""
    with contextlib.ExitStack() as stack:
        for cap in capabilities:
            context = cap.engine_context(args)
            if context is not None:
                stack.enter_context(context)
        yield
