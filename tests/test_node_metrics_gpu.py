"""The GPU probe against a stand-in for NVML (no driver here), with the figures one H100 gave.

On the device (one H100, driver 580.159.04, 2026-11-27) NVML's first memory call counted the
driver's 480 MiB of reserved memory as used: an idle GPU read 480 MiB where `nvidia-smi` read 0,
and every sample of a job was 480 MiB above nvidia-smi's. Its v2 gives the reserved memory apart.
"""

from __future__ import annotations

import sys
import types

import pytest

from orchestrator.node.node_metrics import GpuProbe

MiB = 2**20
TOTAL = 81559 * MiB
RESERVED = 480 * MiB


class NVMLError(Exception):
    pass


def fake_nvml(used: int, *, has_v2: bool = True, v2_error: bool = False) -> types.ModuleType:
    """NVML as the H100 answered: v1's `used` holds the reserved memory, v2's does not."""
    nvml = types.ModuleType("pynvml")
    nvml.calls = []  # type: ignore[attr-defined]
    nvml.nvmlInit = lambda: None  # type: ignore[attr-defined]
    nvml.nvmlShutdown = lambda: None  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetHandleByIndex = lambda i: f"handle-{i}"  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetIndex = lambda h: int(h.rsplit("-", 1)[1])  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetName = lambda h: b"NVIDIA H100 80GB HBM3"  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=11, memory=3)  # type: ignore[attr-defined]
    if has_v2:
        nvml.nvmlMemory_v2 = 33554472  # type: ignore[attr-defined]

    def memory(handle, version=None):
        nvml.calls.append(version)  # type: ignore[attr-defined]
        if version is None:
            return types.SimpleNamespace(
                total=TOTAL, used=used + RESERVED, free=TOTAL - used - RESERVED
            )
        if not has_v2:  # an old binding: no `version` parameter
            raise TypeError(
                "nvmlDeviceGetMemoryInfo() got an unexpected keyword argument 'version'"
            )
        if v2_error:  # a driver without nvmlDeviceGetMemoryInfo_v2
            raise NVMLError("Function Not Found")
        return types.SimpleNamespace(
            version=version, total=TOTAL, reserved=RESERVED, used=used, free=TOTAL - used - RESERVED
        )

    nvml.nvmlDeviceGetMemoryInfo = memory  # type: ignore[attr-defined]
    return nvml


def probe_with(monkeypatch: pytest.MonkeyPatch, nvml: types.ModuleType) -> GpuProbe:
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    probe = GpuProbe(["0"])
    assert probe.names == {0: "NVIDIA H100 80GB HBM3"}
    return probe


def test_memory_used_leaves_out_the_drivers_reserved_memory_as_nvidia_smi_does(monkeypatch):
    # nvidia-smi during the job: 1379 MiB at the peak; NVML v1 said 1859 MiB.
    probe = probe_with(monkeypatch, fake_nvml(1379 * MiB))
    (gpu,) = probe.sample()
    assert (gpu.index, gpu.utilization_pct) == (0, 11.0)
    assert gpu.memory_used_bytes == 1379 * MiB
    assert gpu.memory_total_bytes == TOTAL


def test_an_idle_gpu_reads_zero_used(monkeypatch):
    probe = probe_with(monkeypatch, fake_nvml(0))
    assert probe.sample()[0].memory_used_bytes == 0


@pytest.mark.parametrize(
    "nvml_kw", [{"has_v2": False}, {"v2_error": True}], ids=["old-binding", "old-driver"]
)
def test_without_v2_the_first_call_is_used_and_v2_is_not_asked_again(monkeypatch, nvml_kw):
    nvml = fake_nvml(1379 * MiB, **nvml_kw)
    probe = probe_with(monkeypatch, nvml)
    for _ in range(3):
        (gpu,) = probe.sample()
        assert gpu.memory_used_bytes == (1379 + 480) * MiB  # what v1 gives: better than nothing
    assert nvml.calls.count(None) == 3
    assert len([c for c in nvml.calls if c is not None]) <= 1  # v2 tried once at most


def test_a_gpu_that_fails_both_calls_is_left_out_and_v2_is_kept(monkeypatch):
    nvml = fake_nvml(1379 * MiB)

    def lost(handle, version=None):
        raise NVMLError("GPU is lost")

    good = nvml.nvmlDeviceGetMemoryInfo
    nvml.nvmlDeviceGetMemoryInfo = lost  # type: ignore[attr-defined]
    probe = probe_with(monkeypatch, nvml)
    assert probe.sample() == []
    nvml.nvmlDeviceGetMemoryInfo = good  # type: ignore[attr-defined]
    assert probe.sample()[0].memory_used_bytes == 1379 * MiB  # v2 still asked: not given up
