"""The one device choice (``slimspec_convert/devices.py``): names, the auto dtype per device, and the
clock that synchronises before reading."""

from __future__ import annotations

import time

import pytest
import torch

from slimspec_convert.devices import (
    check_device_name,
    check_run_dtype,
    clock_ms,
    emulated_dtype_warning,
    module_device,
    resolve_device,
    resolve_dtype,
)

NO_CUDA = not torch.cuda.is_available()


@pytest.mark.parametrize("name", ["auto", "cpu", "cuda", "cuda:0", "cuda:3"])
def test_device_names_accepted(name):
    check_device_name("GenerateConfig", name)  # availability is checked when the device is resolved


@pytest.mark.parametrize("name", ["gpu", "cuda:", "cuda:x", "CPU", "mps"])
def test_device_names_refused_naming_the_field(name):
    with pytest.raises(
        ValueError, match=rf"GenerateConfig.device='{name}': expected auto, cpu, cuda or cuda:N"
    ):
        check_device_name("GenerateConfig", name)


def test_auto_is_cuda_exactly_when_torch_sees_a_gpu():
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device(None) == resolve_device("auto")
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")


@pytest.mark.skipif(not NO_CUDA, reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_names_the_fix():
    with pytest.raises(
        ValueError, match=r"device='cuda' but torch.cuda.is_available\(\) is False; use --device cpu"
    ):
        resolve_device("cuda")


def test_auto_dtype_is_bf16_on_cuda_and_float32_on_cpu():
    assert resolve_dtype("auto", torch.device("cpu")) is torch.float32  # on the CPU nothing changes
    assert resolve_dtype(None, torch.device("cpu")) is torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) is torch.bfloat16
    assert resolve_dtype("auto", torch.device("cuda", 1)) is torch.bfloat16
    assert resolve_dtype("fp16", torch.device("cpu")) is torch.float16  # an explicit name wins
    assert resolve_dtype("float32", torch.device("cuda")) is torch.float32
    check_run_dtype("X", "auto")
    with pytest.raises(ValueError, match=r"X.dtype='fp8': expected auto or one of \['bf16', 'bfloat16'"):
        check_run_dtype("X", "fp8")


def test_clock_ms_measures_wall_time_in_milliseconds():
    t0 = clock_ms("cpu")
    time.sleep(0.05)
    elapsed = clock_ms(torch.device("cpu")) - t0
    assert 50.0 <= elapsed < 1000.0


def test_module_device():
    assert module_device(torch.nn.Linear(2, 2)) == torch.device("cpu")
    assert module_device(torch.nn.Linear(2, 2, device="meta")) == torch.device("meta")
    assert module_device(torch.nn.ReLU()) == torch.device("cpu")  # no parameters


@pytest.mark.parametrize(
    "dtype, flags, emulated",
    [
        (torch.bfloat16, {"avx2", "fma"}, True),
        (torch.bfloat16, {"avx2", "avx512_bf16"}, False),
        (torch.bfloat16, {"amx_bf16"}, False),
        (torch.float16, {"avx2", "avx512_bf16"}, True),
        (torch.float16, {"avx512_fp16"}, False),
        (torch.float32, set(), False),
    ],
)
def test_half_precision_on_a_cpu_without_its_units_is_flagged(monkeypatch, dtype, flags, emulated):
    from slimspec_convert import devices

    monkeypatch.setattr(devices, "_cpu_flags", lambda: flags)
    msg = emulated_dtype_warning(dtype, torch.device("cpu"))
    assert (msg is not None) == emulated
    if emulated:
        assert msg.startswith(f"{str(dtype).removeprefix('torch.')} on this CPU is emulated")
    assert emulated_dtype_warning(dtype, torch.device("cuda")) is None  # CUDA has its own kernels
