"""Where capabilities meet, as declared data (trl_fp8.composition): the set-up order derived from ``after``,
conflicts and exclusions checked once at config time, and one winner among several offers."""

import random
from types import SimpleNamespace

import pytest

from trl_fp8 import composition
from trl_fp8.registry import CAPABILITIES
from trl_fp8.capability import Capability, Conflict


def _cap(name, after=(), overrides=(), excludes=None, conflicts=(), wanted=True):
    return type(name.title(), (Capability,), dict(
        name=name, after=tuple(after), overrides=tuple(overrides), excludes=dict(excludes or {}),
        conflicts=tuple(conflicts), wanted=classmethod(lambda cls, args: wanted)))


def test_the_shipped_order_follows_every_declared_need():
    names = [c.name for c in CAPABILITIES]
    for cap in CAPABILITIES:
        for need in cap.after:
            assert names.index(need) < names.index(cap.name), (cap.name, need)
    assert names.index("fair_cast") > names.index("mxfp8") and names[-2:] == ["sync_checks", "time_budget"]


def test_any_listing_order_gives_an_order_that_respects_after():
    shipped = list(CAPABILITIES)
    for seed in range(20):
        shuffled = shipped[:]
        random.Random(seed).shuffle(shuffled)
        order = [c.name for c in composition.setup_order(tuple(shuffled))]
        for cap in shipped:
            for need in cap.after:
                assert order.index(need) < order.index(cap.name)


def test_a_cycle_or_an_unknown_name_is_refused_at_import():
    a, b = _cap("a", after=["b"]), _cap("b", after=["a"])
    with pytest.raises(ValueError, match="cycle: a -> b -> a"):
        composition.setup_order((a, b))
    with pytest.raises(ValueError, match="names 'nope', which is not a capability"):
        composition.setup_order((_cap("a", after=["nope"]),))


def test_conflicts_and_exclusions_are_checked_once_naming_both_sides():
    only_on = _cap("fast", conflicts=[Conflict("batching", "the cache needs the default path.",
                                               when=lambda args: args.fast == "on")],
                   excludes={"mx": "nothing dense to quantize."})
    mx = _cap("mx")
    args = SimpleNamespace(fast="on", batching=True, mx=True)
    with pytest.raises(ValueError, match=r"fast='on' cannot be combined with batching=True: the cache needs"):
        composition.check_conflicts((only_on, mx), args)
    args.batching = False
    with pytest.raises(ValueError, match=r"fast='on' cannot be combined with mx=True: nothing dense to quantize"):
        composition.check_conflicts((only_on, mx), args)
    args.fast, args.batching = "auto", True
    with pytest.raises(ValueError, match="cannot be combined with mx=True"):  # `when` spares 'auto' the first
        composition.check_conflicts((only_on, mx), args)
    composition.check_conflicts((only_on,), args)


@pytest.mark.parametrize("fields, message", [
    (dict(fair_cast="stochastic", use_transformers_continuous_batching=True),
     "fair_cast='stochastic' cannot be combined with use_transformers_continuous_batching=True: TRL's"),
    (dict(duet=True, use_transformers_continuous_batching=True),
     "duet=True cannot be combined with use_transformers_continuous_batching=True"),
    (dict(mxfp8=True, use_transformers_continuous_batching=True),
     "mxfp8=True cannot be combined with use_transformers_continuous_batching=True"),
    (dict(fast_qlora="on", mxfp8=True), "fast_qlora='on' cannot be combined with mxfp8=True"),
])
def test_the_shipped_conflicts_refuse_at_config_time(tmp_path, fields, message):
    import trl_fp8

    with pytest.raises(ValueError, match=message):
        trl_fp8.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", **fields)


def test_one_offer_wins_by_declared_overrides_and_two_undeclared_are_an_error():
    fair, fast, other = _cap("fair", overrides=["fast"]), _cap("fast"), _cap("other")
    assert composition.winner({fair: "copy", fast: "dense"}) == "copy"
    assert composition.winner({fair: None, fast: "dense"}) == "dense"
    assert composition.winner({fair: None, fast: None}) is None
    with pytest.raises(RuntimeError, match="none overrides the others"):
        composition.winner({fast: "dense", other: "x"})


def test_mutual_overrides_are_named_as_such():
    a, b = _cap("a", overrides=["b"]), _cap("b", overrides=["a"])
    with pytest.raises(ValueError, match="override each other"):
        composition.setup_order((a, b))
    with pytest.raises(RuntimeError, match=r"\['a', 'b'\] override each other"):
        composition.winner({a: "offer a", b: "offer b"})


def test_the_resolved_composition_is_printed_at_start(tmp_path, demo_dir, capsys):
    """The sampling decision is installed once; what is printed at start (where a user sees it, as TRL prints its
    settings) says who samples and what it is sent, who set up in which order, who generates and who observes
    every sync."""
    import trl_fp8
    from trl_fp8.app.tasks.arithmetic import correctness_reward, make_arithmetic_dataset

    args = trl_fp8.GRPOConfig(output_dir=str(tmp_path / "run"), use_cpu=True, bf16=False, max_steps=1,
                              per_device_train_batch_size=4, num_generations=4, max_completion_length=4,
                              report_to="none", save_strategy="no", fair_cast="stochastic", duet=True)
    trainer = trl_fp8.GRPOTrainer(model=demo_dir, reward_funcs=[correctness_reward], args=args,
                                  train_dataset=make_arithmetic_dataset(8, seed=1))
    text = capsys.readouterr().out
    assert "capabilities in set-up order: fair_cast -> duet -> sync_checks" in text
    assert "trl_fp8 sampling: an in-process twin in the served dtype; owner: fair_cast; policy: full model" in text
    assert trainer.sampling.kind == "twin" and trainer.offer().kind == "twin"
    assert "observers of every sync: sync_checks" in text and "in-process generation path: duet" in text
    offer = trainer.offer()
    assert offer.owner == "fair_cast" and offer.model is trainer.capability("fair_cast").sampler.model
