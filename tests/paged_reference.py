"""flashinfer's two paged attention wrappers as plain torch loops: what their plan() and run()
compute, request by request, written from flashinfer's documentation. The CUDA driver runs on
them on the CPU, so that its planning (groups, CSR arrays, masks, graph padding) is checked
against the driver contract without a GPU; on a GPU it runs on flashinfer itself."""

from __future__ import annotations

from typing import Any

import torch


class _PagedWrapper:
    def __init__(
        self,
        workspace: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        paged_kv_indptr_buffer: torch.Tensor | None = None,
        paged_kv_indices_buffer: torch.Tensor | None = None,
        paged_kv_last_page_len_buffer: torch.Tensor | None = None,
        backend: str = "auto",
    ) -> None:
        assert kv_layout == "NHD"
        self.graph_buffers = (
            (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
            if use_cuda_graph
            else None
        )
        self.planned: dict[str, Any] = {}

    def _keep(self, indptr: torch.Tensor, indices: torch.Tensor, last: torch.Tensor) -> None:
        """What plan() copies; a graph wrapper keeps it in its fixed buffers, as flashinfer does,
        and refuses a batch of another size."""
        for tensor in (indptr, indices, last):
            assert tensor.dtype == torch.int32 and tensor.device.type == "cpu"
        if self.graph_buffers is None:
            self.planned.update(indptr=indptr, indices=indices, last=last)
            return
        b_indptr, b_indices, b_last = self.graph_buffers
        assert b_indptr is not None and b_indices is not None and b_last is not None
        assert len(last) == len(b_last), "a graph wrapper runs one batch size"
        b_indptr.copy_(indptr)
        b_indices[: len(indices)].copy_(indices)
        b_last.copy_(last)
        self.planned.update(indptr=b_indptr, indices=b_indices, last=b_last)

    def _request_kv(self, pages: torch.Tensor, r: int, page_size: int) -> tuple[torch.Tensor, ...]:
        indptr, indices, last = (self.planned[k].tolist() for k in ("indptr", "indices", "last"))
        chosen = torch.tensor(indices[indptr[r] : indptr[r + 1]], dtype=torch.long)
        kv_len = (len(chosen) - 1) * page_size + last[r]
        k = pages[chosen, 0].reshape(-1, *pages.shape[-2:])[:kv_len]
        v = pages[chosen, 1].reshape(-1, *pages.shape[-2:])[:kv_len]
        return k, v

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """q [n, Hq, D], k/v [L, Hkv, D], mask [n, L] -> [n, Hq, D]; a row seeing nothing is 0."""
        group = q.shape[1] // k.shape[1]
        k = k.float().repeat_interleave(group, dim=1)
        v = v.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("nhd,lhd->hnl", q.float(), k) / q.shape[-1] ** 0.5
        scores = scores.masked_fill(~mask[None], float("-inf"))
        weights = torch.nan_to_num(scores.softmax(-1), nan=0.0)
        return torch.einsum("hnl,lhd->nhd", weights, v).to(q.dtype)


class BatchDecodeWithPagedKVCacheWrapper(_PagedWrapper):
    def plan(
        self,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        **options: Any,
    ) -> None:
        self._keep(indptr, indices, last_page_len)
        self.planned.update(page_size=page_size, heads=(num_qo_heads, num_kv_heads, head_dim))

    def run(self, q: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
        batch = len(self.planned["last"])
        assert q.shape[0] == batch
        out = torch.empty_like(q)
        for r in range(batch):
            k, v = self._request_kv(pages, r, self.planned["page_size"])
            out[r : r + 1] = self._attend(
                q[r : r + 1], k, v, torch.ones(1, len(k), dtype=torch.bool)
            )
        return out


class BatchPrefillWithPagedKVCacheWrapper(_PagedWrapper):
    def plan(
        self,
        qo_indptr: torch.Tensor,
        paged_kv_indptr: torch.Tensor,
        paged_kv_indices: torch.Tensor,
        paged_kv_last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        page_size: int,
        custom_mask: torch.Tensor | None = None,
        causal: bool = False,
        **options: Any,
    ) -> None:
        self._keep(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len)
        self.planned.update(
            qo_indptr=qo_indptr.tolist(),
            page_size=page_size,
            mask=None if custom_mask is None else custom_mask.cpu(),
            causal=causal,
        )

    def run(self, q: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
        qo = self.planned["qo_indptr"]
        assert q.shape[0] == qo[-1]
        out = torch.empty_like(q)
        mask_cursor = 0
        for r in range(len(qo) - 1):
            k, v = self._request_kv(pages, r, self.planned["page_size"])
            n, kv_len = qo[r + 1] - qo[r], len(k)
            if self.planned["mask"] is not None:
                flat = self.planned["mask"][mask_cursor : mask_cursor + n * kv_len]
                mask = flat.view(n, kv_len)
                mask_cursor += n * kv_len
            elif self.planned["causal"]:
                mask = torch.arange(kv_len)[None, :] <= (kv_len - n + torch.arange(n))[:, None]
            else:
                mask = torch.ones(n, kv_len, dtype=torch.bool)
            out[qo[r] : qo[r + 1]] = self._attend(q[qo[r] : qo[r + 1]], k, v, mask)
        return out


def _rmsnorm(
    input: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    out: torch.Tensor | None = None,
    enable_pdl: bool | None = None,
) -> torch.Tensor:
    x = input.float()
    normed = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(
        input.dtype
    )
    if out is None:
        return normed
    out.copy_(normed)
    return out


def _fused_add_rmsnorm(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    enable_pdl: bool | None = None,
) -> None:
    residual.add_(input)
    input.copy_(_rmsnorm(residual, weight, eps))


def _apply_rope_with_cos_sin_cache_inplace(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> None:
    assert is_neox and cos_sin_cache.dtype == torch.float32
    half = cos_sin_cache.shape[-1] // 2
    cos = cos_sin_cache[positions, :half][:, None, :]
    sin = cos_sin_cache[positions, half:][:, None, :]
    for x in (query, key):
        heads = x.view(x.shape[0], -1, head_size)
        first, second = heads[..., :half].float(), heads[..., half:].float()
        rotated = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
        heads.copy_(rotated.to(heads.dtype))


class norm:  # noqa: N801  (stands for the flashinfer.norm module)
    rmsnorm = staticmethod(_rmsnorm)
    fused_add_rmsnorm = staticmethod(_fused_add_rmsnorm)


class rope:  # noqa: N801  (stands for the flashinfer.rope module)
    apply_rope_with_cos_sin_cache_inplace = staticmethod(_apply_rope_with_cos_sin_cache_inplace)
