"""The CUDA driver: the torch driver's model, checks and samplers, with attention on flashinfer's
paged kernels and decode passes replayed from CUDA graphs.

A pass is validated, then split into decode, causal and custom-mask groups (paged_plan), each
planned once from CPU index arrays and reused by every layer. A pass that is all plain decode
and fits a captured bucket replays that bucket's graph; everything else runs eagerly. Slots are
sampled and probed on the device and come back in one copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch

from pie.drivers.batch import ForwardBatch
from pie.drivers.cuda_graphs import DecodeGraph, DecodeGraphs, graph_buckets
from pie.drivers.fused_layers import layer_kernels_for
from pie.drivers.host_copies import device_tensor
from pie.drivers.kvcache import KvCacheShape, PagedKvCache
from pie.drivers.lora import LoraAdapters
from pie.drivers.media_store import MediaStore
from pie.drivers.models.base import PLAIN_ATTENTION, CausalLM, ModelConfig
from pie.drivers.paged_kernels import PagedKernels
from pie.drivers.paged_plan import AttentionPlan, plan_attention
from pie.drivers.torch_driver import Chained, TorchDriver


class CudaDriver(TorchDriver):
    """A Driver for one CUDA device. `kernels` is the flashinfer module (its two paged
    wrapper classes, and its norm and rope kernels, which the model is switched to), which
    runs bfloat16 and float16 (select.PAGED_DTYPES).
    `graph_batch_sizes`: the decode buckets to capture (empty: the defaults; None: no CUDA
    graphs). One page beyond `num_pages` is kept as the graphs' scratch page. Passes that name a
    LoRA adapter or carry media run eagerly; `media` is the model's media store (encoders run
    on the model's device)."""

    def __init__(
        self,
        model: CausalLM,
        config: ModelConfig,
        *,
        kernels: ModuleType | Any,
        page_size: int,
        num_pages: int,
        max_batch_tokens: int,
        max_batch_requests: int,
        device: str,
        dtype: torch.dtype,
        model_name: str,
        graph_batch_sizes: Sequence[int] | None = (),
        capture: bool = True,
        seed: int | None = None,
        adapters: LoraAdapters | None = None,
        media: MediaStore | None = None,
    ) -> None:
        if any(layer != PLAIN_ATTENTION for layer in model.attention_layers()):
            raise ValueError(
                f"{config.model_type!r} has sliding-window, soft-capped or rescaled attention "
                "layers, which the CUDA driver does not run yet; use the torch driver "
                '([driver] backend = "torch")'
            )
        super().__init__(
            model,
            config,
            page_size=page_size,
            num_pages=num_pages,
            max_batch_tokens=max_batch_tokens,
            max_batch_requests=max_batch_requests,
            device=device,
            dtype=dtype,
            model_name=model_name,
            seed=seed,
            adapters=adapters,
            media=media,
        )
        self.layer_kernels = layer_kernels_for(kernels)
        model.use_kernels(self.layer_kernels)
        self.kernels = PagedKernels(
            kernels, self.cache, num_heads=config.num_heads, device=self.cache.device
        )
        self._planned: torch.cuda.Event | None = None
        """Marks the end of the last pass's planning copies (see _prepare)."""
        self.graphs: DecodeGraphs | None = None
        if graph_batch_sizes is not None:
            self.graphs = DecodeGraphs(
                model,
                self.kernels,
                buckets=graph_buckets(graph_batch_sizes, max_batch_requests),
                scratch_page=num_pages,
                max_pages_per_request=-(-config.max_position_embeddings // page_size),
            )
            if capture:
                with torch.inference_mode():
                    self.graphs.capture()

    def _new_cache(self, shape: KvCacheShape, num_pages: int, device: str) -> PagedKvCache:
        return PagedKvCache(shape, num_pages + 1, device)

    def _prepare(self, batch: ForwardBatch, chained: Chained | None) -> Any:
        # Planning writes each wrapper's pinned host buffers (and a graph's static host inputs),
        # which the device copies from in stream order: the last pass's copies must be done
        # before this plan overwrites them; every earlier pass's are done before the last's.
        if self._planned is not None:
            self._planned.synchronize()
        plan = plan_attention(batch, self.info.page_size)
        # The graphs were captured with no adapter chosen: a pass that names one runs eagerly.
        adapted = any(name is not None for name in batch.adapters)
        # Graphs hold token embeddings only: a pass with soft tokens (media) runs eagerly.
        graph = None if adapted or batch.media else self._graph_for(plan)
        prepared: Any
        if graph is not None:
            positions = self._rope_positions(batch)
            graph.prepare(batch.token_ids, positions, plan.write_rows, plan.groups[0], chained)
            prepared = graph
        else:
            prepared = self.kernels.attention(plan, batch.num_tokens)
        if self.cache.device.type == "cuda":
            self._planned = torch.cuda.Event()
            self._planned.record()
        return prepared

    def _graph_for(self, plan: AttentionPlan) -> DecodeGraph | None:
        if self.graphs is None or not plan.is_decode_only:
            return None
        return self.graphs.for_group(plan.groups[0])

    def _slot_logits(
        self, batch: ForwardBatch, prepared: Any, chained: Chained | None
    ) -> torch.Tensor | None:
        if not isinstance(prepared, DecodeGraph):
            return super()._slot_logits(batch, prepared, chained)
        logits = prepared.replay()
        if not batch.slot_ops:
            return None
        return logits.index_select(0, device_tensor(batch.slot_tokens, torch.long, logits.device))
