"""TRL's packed "tree" attention where its CUDA kernel is not available: an exact pure-PyTorch implementation.

TRL's `AsyncGRPOTrainer` packs the samples of a micro-batch into one prefix trie per row (`packing.TreeRow`): a token
several samples share is forwarded once, and each trie segment attends to the keys and values of its root-to-segment
path. TRL computes that with FlashAttention-3's variable-length kernel, fetched from the hub on first use
(`packing._flash_attn`): CUDA (and ROCm) only, with the `kernels` package and the hub reachable. `tree_attention`
computes the same thing segment by segment with the softmax of eager attention: for every segment, its queries
against the keys gathered at its path, causal with the two aligned at their ends (a segment's queries are the last
tokens of its path), with the kernel's options (grouped-query heads, `scaling`, `sliding_window`, `softcap`). It runs
in the inputs' dtype, where the kernel casts float32 to half precision first: in float32 or float64 it is exact to
that precision (`tests/test_tree_attention.py` checks it against dense causal attention on each sample alone).
"""

from __future__ import annotations

import warnings

import torch
from transformers import AttentionInterface


__all__ = ["register_tree_attention_without_kernel", "tree_attention"]


def tree_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    tree_kv_index: torch.Tensor,
    tree_cu_seqlens_q: torch.Tensor,
    tree_cu_seqlens_k: torch.Tensor,
    tree_max_seqlen_q: int,
    tree_max_seqlen_k: int,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """What `trl.experimental.async_grpo.packing.tree_attention` computes, as an attention function of transformers.

    `query` is `(1, heads, N, head_dim)` over the row's N packed tokens, `key` and `value` `(1, kv_heads, N,
    head_dim)`; segment s holds the queries `tree_cu_seqlens_q[s]:tree_cu_seqlens_q[s + 1]` and attends to the packed
    positions `tree_kv_index[tree_cu_seqlens_k[s]:tree_cu_seqlens_k[s + 1]]`. Returns `(1, N, heads, head_dim)`.
    Dropout is not applied, as in the kernel call.
    """
    query, key, value = query[0], key[0], value[0]
    heads, kv_heads = query.shape[0], key.shape[0]
    # Grouped-query attention: query head h reads key/value head h // (heads / kv_heads), as the kernel does
    key = key.index_select(1, tree_kv_index).repeat_interleave(heads // kv_heads, dim=0)
    value = value.index_select(1, tree_kv_index).repeat_interleave(heads // kv_heads, dim=0)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    output = query.new_empty(query.shape[1], heads, query.shape[2])
    bounds_q, bounds_k = tree_cu_seqlens_q.tolist(), tree_cu_seqlens_k.tolist()
    for q_start, q_end, k_start, k_end in zip(bounds_q[:-1], bounds_q[1:], bounds_k[:-1], bounds_k[1:], strict=True):
        scores = query[:, q_start:q_end] @ key[:, k_start:k_end].transpose(-1, -2) * scaling
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        # Query i of a segment is token i + (path length - segment length) of its path
        offset = (k_end - k_start) - (q_end - q_start)
        position_q = torch.arange(q_end - q_start, device=query.device)[:, None] + offset
        position_k = torch.arange(k_end - k_start, device=query.device)[None, :]
        visible = position_k <= position_q
        if sliding_window:
            visible &= position_q - position_k < sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        # Softmax in float32 at least, as eager attention takes it (and in float64 for float64 inputs)
        probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))
        output[q_start:q_end] = (probs.to(query.dtype) @ value[:, k_start:k_end]).transpose(0, 1)
    return output.unsqueeze(0), None


def register_tree_attention_without_kernel(name: str, device: torch.device) -> bool:
    """Register `tree_attention` under TRL's attention name `name` unless TRL's kernel runs on `device`.

    Without CUDA there is no kernel; on CUDA, TRL's `packing._flash_attn` fetches it from the hub (package `kernels`),
    and where that fails (offline, no `kernels`) this warns with the reason and registers the PyTorch version, exact
    but slower. Registration is global (transformers' `AttentionInterface`), as TRL's own is; each layer looks its
    attention function up at every forward. Returns whether it registered.
    """
    if device.type == "cuda":
        from trl.experimental.async_grpo import packing

        try:
            packing._flash_attn()
            return False
        except Exception as error:  # noqa: BLE001  (whatever stops the kernel, the attention still has to run)
            warnings.warn(
                f"TRL's FlashAttention-3 kernel for packed attention could not be loaded ({type(error).__name__}: "
                f"{error}); the packed rows are attended in PyTorch instead (trl_dppo.tree_attention), exact but "
                "slower. `pip install kernels` with the hub reachable gives TRL's kernel.",
                stacklevel=2,
            )
    AttentionInterface.register(name, tree_attention)
    return True
