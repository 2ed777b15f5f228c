"""pytest plugin for TRL's suite (see run.sh): load the fabricated Hub datasets from their local snapshots, and in
modes "defaults" / "features" make ``trl.GRPOTrainer`` / ``trl.GRPOConfig`` trl_fp8's."""

import glob
import os

import datasets

_load_dataset = datasets.load_dataset
_HUB = os.path.join(os.environ["HF_HOME"], "hub")


def _local_snapshot(path):
    if isinstance(path, str) and path.startswith("trl-internal-testing/"):
        found = glob.glob(os.path.join(_HUB, "datasets--" + path.replace("/", "--"), "snapshots", "*"))
        if found:
            return found[0]
    return path


def load_dataset(path, *args, **kwargs):  # datasets' offline mode does not read the hub cache by repo id
    return _load_dataset(_local_snapshot(path), *args, **kwargs)


datasets.load_dataset = load_dataset

MODE = os.environ.get("TRL_FP8_SUITE_MODE", "features")
if MODE in ("defaults", "features"):
    import trl

    import trl_fp8

    FEATURES = {"fair_cast": "stochastic", "sync_checks": "all"} if MODE == "features" else {}

    class GRPOConfig(trl_fp8.GRPOConfig):  # a module-level class: configs are pickled by some tests
        def __init__(self, *args, **kwargs):
            for key, value in FEATURES.items():
                kwargs.setdefault(key, value)
            super().__init__(*args, **kwargs)

    trl.GRPOTrainer = trl_fp8.GRPOTrainer
    trl.GRPOConfig = GRPOConfig
