"""The wasm sandbox: compiled-component cache, host-function plumbing, and the runner that
keeps each inferlet instance inside its budget, memory cap and kill switch."""

from __future__ import annotations

from pie.sandbox.cache import ComponentCache, InvalidProgram
from pie.sandbox.runtime import (
    GuestStopped,
    KillSwitch,
    RunOutcome,
    RunStatus,
    SandboxLimits,
    SandboxStatistics,
    WasmRuntime,
)
from pie.sandbox.wasm import Err, Ok, add_host_func, install_thread_safe_exceptions, record

__all__ = [
    "ComponentCache",
    "Err",
    "GuestStopped",
    "InvalidProgram",
    "KillSwitch",
    "Ok",
    "RunOutcome",
    "RunStatus",
    "SandboxLimits",
    "SandboxStatistics",
    "WasmRuntime",
    "add_host_func",
    "install_thread_safe_exceptions",
    "record",
]
