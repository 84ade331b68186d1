"""NVML reader against a fake pynvml layer: values, missing library, driver not loaded, no devices."""

from __future__ import annotations

import builtins
import types

from btbctl.engine.telemetry.nvml import read_gpus


class NVMLError(Exception):
    pass


class NVMLError_LibraryNotFound(NVMLError):
    pass


class NVMLError_DriverNotLoaded(NVMLError):
    pass


def fake_nvml(devices=(), init_error=None, util_error=False):
    calls = []

    def init():
        calls.append("init")
        if init_error is not None:
            raise init_error

    def util(h):
        if util_error:
            raise NVMLError("Not Supported")
        return types.SimpleNamespace(gpu=devices[h][3])

    mod = types.SimpleNamespace(
        NVMLError=NVMLError,
        NVMLError_LibraryNotFound=NVMLError_LibraryNotFound,
        NVMLError_DriverNotLoaded=NVMLError_DriverNotLoaded,
        nvmlInit=init,
        nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetCount=lambda: len(devices),
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetName=lambda h: devices[h][0],
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=devices[h][1], total=devices[h][2]),
        nvmlDeviceGetUtilizationRates=util,
    )
    return mod, calls


def test_values_are_read_per_device_and_nvml_is_shut_down():
    mod, calls = fake_nvml(
        [(b"NVIDIA H100 80GB HBM3", 10 * 2**30, 80 * 2**30, 37), ("NVIDIA H100 80GB HBM3", 0, 80 * 2**30, 0)]
    )
    res = read_gpus(mod)
    assert res.available and res.reason is None
    assert [(g.index, g.name, g.used_bytes, g.total_bytes, g.util_pct) for g in res.gpus] == [
        (0, "NVIDIA H100 80GB HBM3", 10 * 2**30, 80 * 2**30, 37.0),
        (1, "NVIDIA H100 80GB HBM3", 0, 80 * 2**30, 0.0),
    ]
    assert calls == ["init", "shutdown"]


def test_utilisation_not_supported_is_none():
    mod, _ = fake_nvml([("GPU", 1, 2, 5)], util_error=True)
    assert read_gpus(mod).gpus[0].util_pct is None


def test_library_missing_driver_not_loaded_and_no_devices():
    mod, calls = fake_nvml(init_error=NVMLError_LibraryNotFound("NVML Shared Library Not Found"))
    assert read_gpus(mod).reason == "NVIDIA driver library not found"
    assert "shutdown" not in calls
    mod, _ = fake_nvml(init_error=NVMLError_DriverNotLoaded("Driver Not Loaded"))
    assert read_gpus(mod).reason == "NVIDIA driver not loaded"
    mod, _ = fake_nvml(init_error=NVMLError("Unknown Error"))
    assert read_gpus(mod).reason == "NVML error: Unknown Error"
    mod, _ = fake_nvml([])
    res = read_gpus(mod)
    assert res.reason == "no GPUs found" and not res.available


def test_module_not_installed(monkeypatch):
    real_import = builtins.__import__

    def no_pynvml(name, *a, **kw):
        if name == "pynvml":
            raise ImportError("No module named 'pynvml'")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_pynvml)
    assert read_gpus().reason == "pynvml not installed (pip install 'btbctl[nvml]')"
