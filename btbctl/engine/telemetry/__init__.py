"""Telemetry of the machines the fleet runs on (NVML GPU readings)."""
