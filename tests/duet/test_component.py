

def test_every_duet_field_is_a_resume_field():
    """A resume must match every DUET setting; the list is derived from the fields, so a new one is never left out."""
    import dataclasses

    from trl_fp8.duet.component import Duet, DuetArgs

    assert set(Duet.resume_fields) == {f.name for f in dataclasses.fields(DuetArgs)}
    assert {"duet_screen", "duet_screen_keep_prob", "duet_budget"} <= set(Duet.resume_fields)
