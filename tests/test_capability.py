import pytest

from trl_fp8.capability import check_number


@pytest.mark.parametrize("value", [1, 1.5, 1000.0, float("inf")])
def test_check_number_accepts_reals_at_or_above_the_bound(value):
    check_number("w", value, 1)


@pytest.mark.parametrize("value", [0.5, True, "2", None, float("nan")])
def test_check_number_names_the_field_and_bound(value):
    with pytest.raises(ValueError, match=r"^w must be >= 1, got "):
        check_number("w", value, 1)


def test_check_number_finite_refuses_infinity_and_keeps_the_note():
    check_number("k", 0, 0, finite=True)
    with pytest.raises(ValueError, match=r"^k must be a finite number >= 0 \(pseudo-groups\), got inf\.$"):
        check_number("k", float("inf"), 0, finite=True, note=" (pseudo-groups)")
