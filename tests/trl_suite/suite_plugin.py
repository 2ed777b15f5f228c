"""pytest plugin for TRL's suite (see run.sh): load the fabricated Hub datasets from their local snapshots, and in
modes "defaults" / "features" / "hidden" make ``trl.GRPOTrainer`` / ``trl.GRPOConfig`` trl_fp8's."""

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
# "hidden": the variant issue 30 reported from a review — Fair Cast error feedback, DUET at half the budget, every
# check forced on.
MODE_FEATURES = {"defaults": {}, "features": {"fair_cast": "stochastic", "sync_checks": "all"},
                 "hidden": {"fair_cast": "error_feedback", "duet": True, "duet_budget": 0.5, "sync_checks": "all"},
                 # "passrate": "hidden" with DUET's pass-rate allocator
                 "passrate": {"fair_cast": "error_feedback", "duet": True, "duet_budget": 0.5, "sync_checks": "all",
                              "duet_allocator": "pass_rate"}}
if MODE in MODE_FEATURES:
    import trl

    import trl_fp8

    FEATURES = MODE_FEATURES[MODE]

    class GRPOConfig(trl_fp8.GRPOConfig):  # a module-level class: configs are pickled by some tests
        def __init__(self, *args, **kwargs):
            for key, value in FEATURES.items():
                kwargs.setdefault(key, value)
            super().__init__(*args, **kwargs)

    trl.GRPOTrainer = trl_fp8.GRPOTrainer
    trl.GRPOConfig = GRPOConfig
