import random

import pytest

from trl_fp8.duet.abort import Action, RolloutMonitor
from trl_fp8.duet.markers import MarkerDetector, compile_markers


class _Rng:
    """A scripted random source."""

    def __init__(self, *values):
        self.values = list(values)

    def random(self):
        return self.values.pop(0)


def _monitor(rng, k1=16, k2=32, **kw):
    return RolloutMonitor(MarkerDetector("math"), k1=k1, k2=k2, rng=rng, grace=10, **kw)


def test_markers_presets_and_validation():
    assert MarkerDetector("math").found("so \\boxed{12}")
    assert MarkerDetector("math").found("Final answer: 7")
    assert not MarkerDetector("math").found("\\boxed{12")
    assert MarkerDetector("code").found("```python\nprint(1)\n```")
    assert not MarkerDetector("code").found("```python\nprint(1)\n")
    assert MarkerDetector("qa").found("<answer>Paris</answer>") and MarkerDetector("qa").found("the answer is 4")
    assert MarkerDetector([r"ANS=\d+"]).found("ANS=3")
    with pytest.raises(ValueError, match="duet_markers='latex' is not valid"):
        compile_markers("latex")
    with pytest.raises(ValueError, match="non-empty list"):
        compile_markers([])
    with pytest.raises(ValueError, match="invalid regular expression"):
        compile_markers(["(unclosed"])


def test_free_phase_never_stops():
    m = _monitor(_Rng(0.5))
    for t in range(1, 16):
        assert m.step(t, margin=1.0, tail_text="\\boxed{1}" if t % 8 == 0 else None) is Action.CONTINUE
    assert m.has_marker and m.trim_armed


def test_marker_then_confident_tokens_trim():
    m = _monitor(_Rng(0.5))  # 0.5 >= 0.05: the trim arms
    actions = []
    for t in range(1, 40):
        tail = "x \\boxed{3}" if t == 8 else None
        actions.append(m.step(t, margin=0.95, tail_text=tail))
    # confident from k1=16 on: the 5th consecutive confident token (t=20) stops
    assert actions.index(Action.STOP) == 19
    assert m.stopped and not m.aborted and not m.eps_kept


def test_confidence_run_resets_on_an_unsure_token():
    m = _monitor(_Rng(0.5))
    m.step(8, 0.0, "\\boxed{3}")
    margins = [0.95] * 4 + [0.2] + [0.95] * 5
    actions = [m.step(16 + i, margin) for i, margin in enumerate(margins)]
    assert actions[:9] == [Action.CONTINUE] * 9 and actions[9] is Action.STOP


def test_trim_skipped_with_small_probability():
    m = _monitor(_Rng(0.01))  # 0.01 < 0.05: this rollout never trims
    m.step(8, 0.0, "\\boxed{3}")
    assert all(m.step(t, 0.99) is Action.CONTINUE for t in range(16, 200))


def test_no_marker_aborts_at_k2_plus_grace():
    m = _monitor(_Rng(0.3))  # 0.3 < 0.95 -> abort
    actions = [m.step(t, 0.99, "no answer yet" if t % 8 == 0 else None) for t in range(1, 60)]
    assert actions.index(Action.ABORT) == 41  # t = k2 + grace = 42
    assert m.aborted and m.step(60, 0.0) is Action.ABORT


def test_no_marker_eps_keep_runs_to_the_end_with_weight_flag():
    m = _monitor(_Rng(0.97))  # 0.97 >= 0.95 -> ε-kept
    assert all(m.step(t, 0.99) is Action.CONTINUE for t in range(1, 300))
    assert m.eps_kept and not m.aborted


def test_abort_probability_is_one_minus_keep_prob():
    rng = random.Random(0)
    aborted = 0
    trials = 4000
    for _ in range(trials):
        m = _monitor(rng, k1=1, k2=1)
        for t in range(1, 13):
            m.step(t, 0.0)
        aborted += m.aborted
    assert abs(aborted / trials - 0.95) < 0.015
