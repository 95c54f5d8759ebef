"""The one device choice: names users type (``auto``, ``cpu``, ``cuda``, ``cuda:N``) -> torch devices,
the default dtype of a model run on that device, and clocks that are honest on CUDA.

``auto`` picks CUDA when torch sees a GPU, else the CPU. A model run (``generate``, ``bench e2e``,
``finetune``, the calibration pass of ``convert``, ``rank-sweep``) takes ``dtype='auto'``: bfloat16
on CUDA, float32 on the CPU (unchanged from before devices were a choice). CUDA kernels run
asynchronously, so a stage timer that reads the host clock must synchronise first
(:func:`clock_ms`); on the CPU that is a no-op.
"""

from __future__ import annotations

import time

import torch

from slimspec_convert.dtypes import DTYPES, torch_dtype

DEVICE_NAMES = ("auto", "cpu", "cuda")  # plus "cuda:N"


AUTO_DTYPE = "auto"  # bfloat16 on CUDA, float32 on the CPU


def check_device_name(owner: str, device: str) -> None:
    """Raise unless ``device`` is ``auto``, ``cpu``, ``cuda`` or ``cuda:N`` (availability is checked later).

    Args:
        owner: what holds the value, for the message (e.g. ``"GenerateConfig"``).
        device: the name given.

    Raises:
        ValueError: ``{owner}.device=...: expected auto, cpu, cuda or cuda:N``.
    """
    index = device.partition(":")[2] if device.startswith("cuda:") else None
    if device not in DEVICE_NAMES and not (index is not None and index.isdigit()):
        raise ValueError(f"{owner}.device={device!r}: expected auto, cpu, cuda or cuda:N")


def check_run_dtype(owner: str, dtype: str) -> None:
    """Raise unless ``dtype`` is ``auto`` or a name in :data:`~slimspec_convert.dtypes.DTYPES`.

    Raises:
        ValueError: ``{owner}.dtype=...: expected auto or one of [...]``.
    """
    if dtype != AUTO_DTYPE and dtype not in DTYPES:
        raise ValueError(f"{owner}.dtype={dtype!r}: expected auto or one of {sorted(DTYPES)}")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``auto`` (or None) -> cuda when available, else cpu; ``cpu``, ``cuda``, ``cuda:N`` as given.

    Raises:
        ValueError: cuda asked for but not available, or an unknown name.
    """
    if isinstance(device, torch.device):
        return device
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    check_device_name("device", device)
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but torch.cuda.is_available() is False; use --device cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """The dtype a model runs in: ``auto`` (or None) -> bfloat16 on CUDA, float32 on the CPU.

    Args:
        dtype: ``auto``, None, a name in :data:`~slimspec_convert.dtypes.DTYPES` or a torch dtype.
        device: where the model runs (a resolved device).

    Raises:
        ValueError: an unknown name.
    """
    if dtype is None or dtype == AUTO_DTYPE:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return torch_dtype(dtype)


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued kernels (CUDA); nothing on the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clock_ms(device: torch.device | str) -> float:
    """Host clock in milliseconds after the device's queued work is done (``perf_counter``).

    The difference of two readings is the wall time of the work issued between them, on CUDA too
    (there an unsynchronised reading would time the kernel launches, not the kernels).
    """
    synchronize(device)
    return time.perf_counter() * 1e3


def module_device(module: torch.nn.Module) -> torch.device:
    """The device of a module's first parameter (cpu for a module without parameters)."""
    p = next(module.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


class EmulatedDtypeWarning(UserWarning):
    """A model asked to run in a half-precision dtype that this CPU only emulates (see
    :func:`emulated_dtype_warning`)."""


# CPU flags (Linux /proc/cpuinfo) under which torch multiplies a half-precision dtype in hardware.
NATIVE_CPU_FLAGS = {torch.bfloat16: {"amx_bf16", "avx512_bf16"}, torch.float16: {"amx_fp16", "avx512_fp16"}}


def _cpu_flags() -> set[str]:
    """This CPU's feature flags (empty where /proc/cpuinfo cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return set()


def cpu_has_native_bf16() -> bool:
    """True when this CPU multiplies bfloat16 in hardware (AMX-BF16 or AVX512-BF16 flags, Linux).

    There a bf16 matmul of an LM-head shape runs about 3x faster than float32 (oneDNN; measured on
    this project's 2-core Xeon: [700, 576] x [576, 49152] 0.10 s vs 0.33 s). Elsewhere torch
    emulates bf16 and it is slower than float32, so callers fall back to float32.
    """
    return bool(NATIVE_CPU_FLAGS[torch.bfloat16] & _cpu_flags())


def emulated_dtype_warning(dtype: torch.dtype, device: torch.device) -> str | None:
    """A warning when ``dtype`` on ``device`` is a half-precision type this CPU only emulates, else None.

    Without the flags of :data:`NATIVE_CPU_FLAGS` torch runs bfloat16 and float16 matrix products in
    software: on a 2-core AVX2-only EPYC, [256, 640] x [640, 32768] took 28.4 s in bfloat16 against
    0.105 s in float32 (about 270x), and float16 was as slow. float32 is the right choice there.
    """
    if device.type != "cpu" or dtype not in NATIVE_CPU_FLAGS or NATIVE_CPU_FLAGS[dtype] & _cpu_flags():
        return None
    flags = "/".join(sorted(f.upper() for f in NATIVE_CPU_FLAGS[dtype]))
    return (
        f"{str(dtype).removeprefix('torch.')} on this CPU is emulated (no {flags} in /proc/cpuinfo): "
        "its matrix products run a hundred times slower or more than float32; use --dtype fp32 (or auto)"
    )
