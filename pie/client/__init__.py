"""The Python client for a pie server: `connect` (Trio) and `SyncClient` (plain threads)."""

from __future__ import annotations

from pie.client.bus import Watch
from pie.client.connection import DEFAULT_URL, Client
from pie.client.errors import (
    AuthenticationFailed,
    CannotConnect,
    ConnectionLost,
    EventsOverflowed,
    MessageTooLarge,
    NoSuchInferlet,
    NoSuchProgram,
    NotOwner,
    PieError,
    ServerError,
    WatchOverflowed,
)
from pie.client.inferlet import Outcome, ProgramInfo, RemoteInferlet
from pie.client.opening import connect
from pie.client.sync import SyncClient, SyncInferlet, SyncWatch
from pie.events.inferlet import (
    InferletFailed,
    InferletOutput,
    InferletReturned,
    InferletStarted,
    InferletTerminated,
    SessionMessage,
)
from pie.wire.messages import EngineStatus, InferletSummary, WatchedMessage, Welcome

__all__ = [
    "DEFAULT_URL",
    "AuthenticationFailed",
    "CannotConnect",
    "Client",
    "ConnectionLost",
    "EngineStatus",
    "EventsOverflowed",
    "MessageTooLarge",
    "InferletFailed",
    "InferletOutput",
    "InferletReturned",
    "InferletStarted",
    "InferletSummary",
    "InferletTerminated",
    "NoSuchInferlet",
    "NoSuchProgram",
    "NotOwner",
    "Outcome",
    "PieError",
    "ProgramInfo",
    "RemoteInferlet",
    "ServerError",
    "SessionMessage",
    "SyncClient",
    "SyncInferlet",
    "SyncWatch",
    "Watch",
    "WatchOverflowed",
    "WatchedMessage",
    "Welcome",
    "connect",
]
