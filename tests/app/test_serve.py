"""``trl-fp8 vllm-serve``'s command line: the context and KV cache flags the plan prints reach `vllm serve`; bad
values are one error naming the flag."""

import pytest

from trl_fp8.app.serve import build_command, make_parser


def _args(*argv):
    return make_parser().parse_args(["--model", "trl-fp8:demo-model", *argv])


def test_the_plans_context_and_kv_cache_reach_vllm():
    command, env = build_command(_args("--max_model_len", "768", "--kv_cache_memory_bytes", "7798421098"), True)
    assert command[command.index("--max-model-len") + 1] == "768"
    assert command[command.index("--kv-cache-memory-bytes") + 1] == "7798421098"
    command, _ = build_command(_args(), True)
    assert "--max-model-len" not in command and "--kv-cache-memory-bytes" not in command


@pytest.mark.parametrize("flag", ["--max_model_len", "--kv_cache_memory_bytes"])
def test_a_non_positive_size_is_refused_by_name(flag):
    with pytest.raises(ValueError, match=rf"{flag} must be an integer >= 1, got 0"):
        build_command(_args(flag, "0"), True)
