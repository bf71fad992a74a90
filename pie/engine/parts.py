"""The engine's parts built from its config: the network fetcher and its quota, grammars,
tracing, admission limits, the file layout of the sandbox, a model's locked tokenizer."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pie.actors.inferlet.admission import AdmissionLimits
from pie.actors.inferlet.files import FileLayout, Quota
from pie.config import EngineConfig, GrammarConfig, NetworkConfig, SandboxConfig
from pie.grammar import GrammarLimits, Grammars
from pie.net.fetch import Fetcher, Limits
from pie.net.policy import NetworkPolicy
from pie.net.quota import FetchQuota
from pie.sandbox.host import ModelView

if TYPE_CHECKING:
    from pie.observe.tracing import Tracing


def locked_encode(view: ModelView) -> Callable[[str], list[int]]:
    """The model's tokenizer under the lock every other user of it takes."""

    def encode(text: str) -> list[int]:
        with view.lock:
            return list(view.tokenizer.encode(text))

    return encode


def grammars(config: GrammarConfig, tokenizer: Any, vocab_size: int) -> Grammars | None:
    """The model's grammar engine; none for an engine without a real tokenizer."""
    if not hasattr(tokenizer, "backend_json"):
        return None
    limits = GrammarLimits(
        max_source_bytes=config.max_source_kb << 10,
        cache_entries=config.cache_entries,
        max_matchers_per_user=config.max_matchers_per_user,
    )
    return Grammars(tokenizer.backend_json, vocab_size, sorted(tokenizer.stop_token_ids), limits)


def fetch_quota(config: NetworkConfig) -> FetchQuota:
    return FetchQuota(
        per_inferlet=config.max_fetches_per_inferlet, per_user=config.max_fetches_per_user
    )


def engine_tracing(config: EngineConfig) -> Tracing | None:
    """The engine's spans ([tracing]); None when off, and OpenTelemetry is not even loaded."""
    if not config.tracing.enabled:
        return None
    from pie.observe.tracing import Tracing

    return Tracing(config.tracing)


def fetcher(config: NetworkConfig, tracing: Tracing | None = None) -> Fetcher:
    limits = Limits(
        timeout_seconds=config.timeout_seconds,
        max_response_bytes=int(config.max_response_mb * (1 << 20)),
        max_redirects=config.max_redirects,
    )
    policy = NetworkPolicy.parse(config.allow, config.deny)
    return Fetcher(policy, limits, max_connections=config.max_connections, tracing=tracing)


def admission_limits(sandbox: SandboxConfig) -> AdmissionLimits:
    return AdmissionLimits(
        max_concurrent=sandbox.max_concurrent,
        max_per_user=sandbox.max_inferlets_per_user,
        max_running_per_user=sandbox.max_running_per_user,
        max_children=sandbox.max_children,
        max_depth=sandbox.max_child_depth,
        memory_cap=sandbox.memory_mb << 20,
        memory_budget=sandbox.guest_memory_bytes,
        max_session_messages=sandbox.max_session_messages,
        max_session_bytes=int(sandbox.max_session_mb * (1 << 20)),
        max_user_session_bytes=int(sandbox.max_user_session_mb * (1 << 20)),
    )


def file_layout(config: SandboxConfig) -> FileLayout:
    return FileLayout(
        scratch_root=config.scratch_dir,
        scratch_quota=Quota(
            max_bytes=config.scratch_quota_mb * (1 << 20), max_files=config.scratch_max_files
        ),
        persist_root=config.persist_dir,
        persist_quota=Quota(
            max_bytes=config.persist_quota_mb * (1 << 20), max_files=config.persist_max_files
        ),
        check_seconds=config.files_check_ms / 1000,
    )
