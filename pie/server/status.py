"""What a client's status request is answered with: the engine's load, memory and models."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pie.wire import messages as msg

if TYPE_CHECKING:
    from pie.engine import Engine


def model_card(name: str, inputs: tuple[str, ...], outputs: tuple[str, ...]) -> msg.ModelCard:
    return msg.ModelCard(name=name, inputs=inputs, outputs=outputs)


def engine_status(engine: Engine, corr: int) -> msg.EngineStatus:
    """The answer to a client's status request: the engine's load and memory, per model."""
    stats = engine.statistics()
    return msg.EngineStatus(
        corr=corr,
        model=engine.info.model_name,
        pages_total=stats.kv.pages_total,
        pages_free=stats.kv.pages_free,
        contexts=stats.kv.contexts,
        passes=stats.inference.passes,
        mean_batch_size=stats.scheduler.mean_batch_size,
        last_pass_ms=stats.inference.last_pass_seconds * 1000,
        inferlets_running=stats.inferlets.running,
        inferlets_queued=stats.inferlets.queued,
        pages_cached=stats.kv.pages_cached,
        prefix_hit_tokens=stats.kv.prefix_hit_tokens,
        driver_threads=engine.info.threads,
        adapters=engine.info.adapters,
        memory_resident_mb=stats.memory.resident,
        memory_model_mb=stats.memory.model,
        memory_kv_used_mb=stats.memory.kv_used,
        memory_kv_pool_mb=stats.memory.kv_pool,
        memory_other_mb=stats.memory.other,
        models=tuple(
            msg.ModelLoad(
                card=model_card(m.name, m.inputs, m.outputs),
                pages_total=m.kv.pages_total,
                pages_free=m.kv.pages_free,
                contexts=m.kv.contexts,
                passes=m.inference.passes,
            )
            for m in stats.models
        ),
    )
