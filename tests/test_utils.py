import torch

from trl_fp8 import get_kbit_device_map


def test_kbit_device_map_on_cpu_is_none():
    if torch.cuda.is_available():
        assert get_kbit_device_map() == {"": 0}
    else:
        assert get_kbit_device_map() is None
