"""The DeepSpeed internals Fair Cast's ZeRO export relies on (trl_fp8.fair_cast.sharded.DeepSpeedExport), pinned:
a DeepSpeed upgrade that moves them fails here, by name, instead of serving other bits silently."""

import inspect

import pytest

deepspeed = pytest.importorskip("deepspeed")
TESTED = "0.19"


def _in_order(source: str, *needles: str) -> bool:
    at = 0
    for needle in needles:
        at = source.find(needle, at)
        if at < 0:
            return False
        at += len(needle)
    return True


def test_tested_deepspeed_version():
    assert deepspeed.__version__.startswith(TESTED), f"Fair Cast's ZeRO export is tested with DeepSpeed {TESTED}.x"


def test_zero12_step_copies_the_fp32_partition_right_after_the_optimizer_step():
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer as Z

    step = inspect.getsource(Z.step)
    assert _in_order(step, "self._optimizer_step(i)", "fp32_partition = self.single_partition_of_fp32_groups[i]",
                     "bit16_partitions[partition_id].data.copy_(fp32_partition.data)", "all_gather_dp_groups(")
    assert _in_order(inspect.getsource(Z.update_lp_params), "bit16_partitions[partition_id].data.copy_(fp32_partition",
                     "all_gather_dp_groups(")
    assert "def _optimizer_step(self, group_no)" in inspect.getsource(Z._optimizer_step)
    init = inspect.getsource(Z.__init__)
    for name in ("single_partition_of_fp32_groups", "bit16_groups_flat", "round_robin_bit16_groups", "partition_size",
                 "real_dp_process_group", "parallel_partitioned_bit16_groups"):
        assert f"self.{name}" in init, name


def test_zero3_step_reassigns_the_partitions_right_after_the_optimizer_step():
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Z

    source = inspect.getsource(Z)  # (its methods are wrapped by an NVTX decorator: read them in the class)
    assert _in_order(source, "def step(self", "self._partition_all_parameters()", "self._optimizer_step(sub_group_id)",
                     "self._reassign_or_swap_out_partitioned_parameters(sub_group_id)", "self._post_step(")
    assert _in_order(source, "def _reassign_or_swap_out_partitioned_parameters(self, sub_group_id)",
                     "self.fp16_partitioned_groups_flat[sub_group_id].data.copy_(",
                     "self.fp32_partitioned_groups_flat[sub_group_id].data)")
    assert _in_order(source, "def _post_step(self",
                     "self.persistent_parameters[0].all_gather(self.persistent_parameters)")
    assert hasattr(Z, "invalidate_secondary_tensor")
