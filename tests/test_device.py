"""Device names to rules: the table lookup and what an unknown GPU is allowed."""

from __future__ import annotations

import pytest

from autotune.config import TrialConfig
from autotune.errors import SpecError
from autotune.knobs import device_rule
from autotune.plan.device import DeviceSpec, GiB, named_device

NAMES = [("NVIDIA L40S", "L40S-48GB"), ("NVIDIA L4", "L4-24GB"), ("A100-SXM4-40GB", "A100-40GB"),
         ("Tesla V100", "V100-16GB"), ("H100 80GB HBM3", "H100-80GB"),
         ("RTX 4090", "RTX4090-24GB")]


@pytest.mark.parametrize("name,key", NAMES)
def test_named_devices(name, key):
    assert named_device(name).name == key


def test_unknown_name_lists_known_ones():
    with pytest.raises(SpecError, match="known:"):
        named_device("Z80")


def test_rules_follow_compute_capability_and_spare_unknown_gpus():
    bf16 = TrialConfig.of(4, 4, precision="bf16")
    assert device_rule(bf16, named_device("V100-16GB")) is not None
    assert device_rule(bf16, named_device("A100-80GB")) is None
    unknown = DeviceSpec("MysteryGPU", "cuda", 48 * GiB, None)
    assert device_rule(bf16, unknown) is None
    assert device_rule(TrialConfig.of(4, 4, precision="tf32"), unknown) is None
