"""GPU memory and utilisation read through NVML (``pynvml``, shipped by the ``nvidia-ml-py`` package).

``pynvml`` is imported inside :func:`read_gpus`, never at module import, so machines without it (and ``btbctl
--help``) pay nothing. Tests pass their own module object as ``module`` to exercise every path without a GPU.

Failure reasons (the text after ``NVML unavailable:`` on the dashboard):

* the module cannot be imported -> ``pynvml not installed (pip install 'btbctl[nvml]')``;
* ``nvmlInit`` raises ``NVMLError_LibraryNotFound`` (no ``libnvidia-ml.so``) -> ``NVIDIA driver library not found``;
* ``nvmlInit`` raises ``NVMLError_DriverNotLoaded`` -> ``NVIDIA driver not loaded``;
* any other ``NVMLError`` -> ``NVML error: <message>``;
* zero devices -> ``no GPUs found``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class GpuReading:
    """One GPU as NVML reports it.

    Attributes:
        index: NVML device index.
        name: device name (e.g. ``NVIDIA H100 80GB HBM3``).
        used_bytes: device memory in use, bytes (``nvmlDeviceGetMemoryInfo().used``).
        total_bytes: device memory, bytes (``.total``).
        util_pct: GPU utilisation over NVML's last sample period, percent 0..100
            (``nvmlDeviceGetUtilizationRates().gpu``); None when the device does not report it.
    """

    index: int
    name: str
    used_bytes: int
    total_bytes: int
    util_pct: float | None


@dataclass(frozen=True, slots=True)
class NvmlResult:
    """What :func:`read_gpus` found: ``gpus`` (possibly empty) and, when NVML could not be used, ``reason``
    (one line, see the module docstring); ``reason`` is None exactly when ``gpus`` is not empty."""

    gpus: tuple[GpuReading, ...]
    reason: str | None

    @property
    def available(self) -> bool:
        return self.reason is None


def _import_pynvml():
    import pynvml  # optional, imported lazily on purpose

    return pynvml


def _reason_for(nv: Any, err: BaseException) -> str:
    """Map an NVML exception to a one-line reason using the module's own error classes when it has them."""
    for attr, text in (
        ("NVMLError_LibraryNotFound", "NVIDIA driver library not found"),
        ("NVMLError_DriverNotLoaded", "NVIDIA driver not loaded"),
        ("NVMLError_NoPermission", "no permission to query the GPUs"),
    ):
        cls = getattr(nv, attr, None)
        if isinstance(cls, type) and isinstance(err, cls):
            return text
    msg = str(err).strip() or type(err).__name__
    return f"NVML error: {msg}"


def read_gpus(module: Any = None) -> NvmlResult:
    """Read every local GPU's memory and utilisation.

    Args:
        module: an object with pynvml's API (``nvmlInit``, ``nvmlShutdown``, ``nvmlDeviceGetCount``,
            ``nvmlDeviceGetHandleByIndex``, ``nvmlDeviceGetName``, ``nvmlDeviceGetMemoryInfo``,
            ``nvmlDeviceGetUtilizationRates``, ``NVMLError``); default: ``import pynvml``.

    Returns:
        An :class:`NvmlResult`; never raises for a missing library, driver or device (those become ``reason``).
    """
    if module is None:
        try:
            module = _import_pynvml()
        except ImportError:
            return NvmlResult((), "pynvml not installed (pip install 'btbctl[nvml]')")
    nv = module
    nvml_error = getattr(nv, "NVMLError", Exception)
    try:
        nv.nvmlInit()
    except nvml_error as e:
        return NvmlResult((), _reason_for(nv, e))
    try:
        count = int(nv.nvmlDeviceGetCount())
        gpus = []
        for i in range(count):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            name = nv.nvmlDeviceGetName(h)
            if isinstance(name, bytes):
                name = name.decode("utf-8", "replace")
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            try:
                util: float | None = float(nv.nvmlDeviceGetUtilizationRates(h).gpu)
            except nvml_error:
                util = None
            gpus.append(GpuReading(i, str(name), int(mem.used), int(mem.total), util))
    except nvml_error as e:
        return NvmlResult((), _reason_for(nv, e))
    finally:
        try:
            nv.nvmlShutdown()
        except nvml_error:
            pass
    if not gpus:
        return NvmlResult((), "no GPUs found")
    return NvmlResult(tuple(gpus), None)
