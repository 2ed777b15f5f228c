from dataclasses import fields

import pytest
import trl

from trl_fp8 import GRPOConfig, TrlParser
from trl_fp8.config import TRL_FP8_FIELDS, check_choice


def _cfg(tmp_path, **kwargs):
    return GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, report_to="none", **kwargs)


def test_subclasses_trl_config():
    assert issubclass(GRPOConfig, trl.GRPOConfig)


def test_trl_fp8_fields_are_exactly_the_added_ones_and_documented():
    ours = {f.name for f in fields(GRPOConfig)}
    theirs = {f.name for f in fields(trl.GRPOConfig)}
    assert ours - theirs == set(TRL_FP8_FIELDS)
    for f in fields(GRPOConfig):
        if f.name in TRL_FP8_FIELDS:
            assert f.metadata.get("help", "").startswith("trl_fp8:"), f.name


def test_defaults_leave_trl_fields_untouched(tmp_path):
    ours = _cfg(tmp_path)
    theirs = trl.GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, report_to="none")
    for f in fields(trl.GRPOConfig):
        if f.name in ("logging_dir",):  # timestamped by transformers
            continue
        assert getattr(ours, f.name) == getattr(theirs, f.name), f.name
    assert ours.trl_fp8_fields() == {
        "metrics_jsonl": None, "precision": None, "lora_serving": "auto", "fair_cast": "off", "served_dtype": "bfloat16", "fair_cast_seed": None,
        "fair_cast_probe": 10,
        "duet": False, "duet_budget": 0.5, "duet_n_min": 2, "duet_n_max": None, "duet_markers": ["math"],
        "duet_abort_keep_prob": 0.05, "duet_min_propensity": 0.05, "duet_max_weight": 1000.0, "duet_prior_strength": 0.0,
        "duet_abort_grace": None, "duet_abort_min_tokens": None, "duet_poll_every": None, "duet_screen": 2,
        "duet_screen_keep_prob": 0.1,
        "duet_refill_tries": 0,
        "duet_allocator": "informativeness",
        "duet_pass_threshold": 0.5,
        "duet_pass_decay": 0.5,
        "sync_checks": "default", "sync_check_interval": 1, "sync_check_action": "raise",
        "mxfp8": False, "mxfp8_kernel": "auto", "mxfp8_exclude": [r"(^|\.)lm_head$", "embed", r"(^|\.)(router|gate)$"],
        "fast_qlora": "off", "qlora_keep_budget_gb": 0.25, "qlora_rollout_cache_gb": None, "qlora_cache_dtype": "auto",
        "qlora_adapter_layers": "all", "time_budget": None, "time_budget_margin": None, "time_budget_scope": "session",
    }


def test_metrics_jsonl_rejects_a_directory(tmp_path):
    with pytest.raises(ValueError, match="metrics_jsonl=.*is a directory"):
        _cfg(tmp_path, metrics_jsonl=str(tmp_path))


def test_metrics_jsonl_rejects_empty(tmp_path):
    with pytest.raises(ValueError, match="metrics_jsonl must be a non-empty file path"):
        _cfg(tmp_path, metrics_jsonl="  ")


def test_metrics_jsonl_accepts_pathlike(tmp_path):
    cfg = _cfg(tmp_path, metrics_jsonl=tmp_path / "m.jsonl")
    assert cfg.metrics_jsonl == str(tmp_path / "m.jsonl")


def test_unknown_keyword_is_refused(tmp_path):
    with pytest.raises(TypeError, match="metrics_jsnol"):
        _cfg(tmp_path, metrics_jsnol="x")


def test_check_choice_names_field_and_allowed_values():
    check_choice("mode", "a", ("a", "b"))
    with pytest.raises(ValueError, match=r"mode='c' is not valid; allowed values: 'a', 'b'"):
        check_choice("mode", "c", ("a", "b"))


def test_trl_parser_reads_trl_fp8_fields_from_yaml(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"output_dir: {tmp_path / 'out'}\nuse_cpu: true\nbf16: false\nreport_to: none\n"
        f"metrics_jsonl: {tmp_path / 'm.jsonl'}\nlearning_rate: 3.0e-6\n"
    )
    (cfg,) = TrlParser((GRPOConfig,)).parse_args_and_config(["--config", str(recipe)])
    assert cfg.metrics_jsonl == str(tmp_path / "m.jsonl")
    assert cfg.learning_rate == 3e-6


def test_trl_parser_validates_yaml_values(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"output_dir: {tmp_path / 'out'}\nuse_cpu: true\nbf16: false\nmetrics_jsonl: {tmp_path}\n")
    with pytest.raises(ValueError, match="metrics_jsonl"):
        TrlParser((GRPOConfig,)).parse_args_and_config(["--config", str(recipe)])
