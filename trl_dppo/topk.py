"""The trainer's log-probabilities at the sampler's kept set, from the hidden states of the loss's own forward pass.

GRPOTrainer scores completions through a fused LM head that never materialises the `(B, T, V)` logits: it returns
log pi(y_t) of each sampled token. The top-K divergence also needs log pi at the sampler's K most likely tokens.
With z = W h + b the LM head's logits and T the temperature,

    log pi(k) = log pi(y) + (z_k - z_y) / T,

so K + 1 dot products per position, on the hidden state the forward pass already computed, give them exactly: no
second forward pass and no full-vocabulary tensor. Models whose logits are not `W h + b` (logit scaling or
softcapping) are rejected by `check_topk_support`. `lm_head_kept_logps` is the trainer's entry point: it reads the
head's weight outside the head's forward pass.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from accelerate.utils import DistributedType
from torch.distributed.tensor import DTensor
from trl.trainer.utils import maybe_gather_lm_head_ctx


__all__ = [
    "check_topk_sharding",
    "check_topk_support",
    "gathered_lm_head",
    "lm_head_kept_logps",
    "topk_logps_from_hidden",
]

# Per chunk, the gathered LM-head rows take positions x (K + 2) x hidden x 4 bytes; this bounds that transient.
_CHUNK_BYTES = 4 * 2**20


def check_topk_support(
    causal_lm: torch.nn.Module,
    needed_by: str = "The top-K divergence",
    remedy: str = "Use divergence='binary_tv' or 'binary_kl'.",
) -> None:
    """Raise if the model's logits are not `lm_head(h)` alone, or if the LM head carries an adapter. `needed_by` names
    what reads the LM head (in the error), `remedy` what to set instead."""
    config = causal_lm.config.get_text_config()
    for name in (
        "final_logit_softcapping",
        "logit_scale",
        "output_multiplier",
        "lm_head_multiplier",
        "logits_scaling",
    ):
        value = getattr(config, name, None)
        if value is not None and value != 1.0:
            raise ValueError(
                f"{needed_by} needs logits equal to lm_head(hidden), but this model's config sets {name}={value}. "
                f"{remedy}"
            )
    head = causal_lm.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(
            f"{needed_by} reads the LM head's weight directly, but the LM head is {type(head).__name__} (an adapter "
            f"on lm_head?). Remove lm_head from the adapter's target modules. {remedy}"
        )


def check_topk_sharding(
    accelerator,
    needed_by: str = "The top-K divergence",
    remedy: str = "Use a binary divergence ('binary_tv', 'binary_kl').",
) -> None:
    """Raise under FSDP1, whose LM head `gathered_lm_head` cannot gather (FSDP2 and DeepSpeed ZeRO-3 it can)."""
    if accelerator.distributed_type == DistributedType.FSDP and not accelerator.is_fsdp2:
        raise ValueError(
            f"{needed_by} reads the LM head's weight outside its forward pass; under FSDP1 that weight is a flat "
            "shard it cannot gather. Use FSDP2 (`fsdp_version: 2`, examples/accelerate_configs/fsdp2.yaml) or "
            f"DeepSpeed ZeRO. {remedy}"
        )


@torch.no_grad()
def topk_logps_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    sampled_ids: torch.Tensor,
    sampled_logps: torch.Tensor,
    kept_ids: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """log pi at the kept ids, `(B, T, K')`, float32; `-inf` in empty slots (id < 0).

    Args:
        hidden: `(B, T, H)` hidden states that predict each completion token.
        weight, bias: the LM head (`(V, H)`, `(V,)` or None).
        sampled_ids: `(B, T)` the sampled tokens.
        sampled_logps: `(B, T)` log pi of the sampled tokens from the same forward pass.
        kept_ids: `(B, T, K')` token ids, -1 for an empty slot.
        temperature: the temperature the trainer divides its logits by.
    """
    B, T, H = hidden.shape
    k = kept_ids.size(-1)
    flat_hidden = hidden.reshape(-1, H)
    flat_sampled = sampled_ids.reshape(-1)
    flat_kept = kept_ids.reshape(-1, k)
    flat_logps = sampled_logps.reshape(-1).float()
    out = torch.empty(flat_kept.shape, dtype=torch.float32, device=hidden.device)
    chunk = max(1, _CHUNK_BYTES // ((k + 1) * H * 4))
    for start in range(0, flat_hidden.size(0), chunk):
        end = min(start + chunk, flat_hidden.size(0))
        ids = torch.cat([flat_sampled[start:end, None], flat_kept[start:end].clamp_min(0)], dim=-1)  # (n, K' + 1)
        rows = weight[ids].float()  # (n, K' + 1, H)
        z = torch.einsum("nh,nkh->nk", flat_hidden[start:end].float(), rows)
        if bias is not None:
            z = z + bias[ids].float()
        out[start:end] = flat_logps[start:end, None] + (z[:, 1:] - z[:, :1]) / temperature
    out.masked_fill_(flat_kept < 0, -math.inf)
    return out.view(B, T, k)


@contextmanager
def gathered_lm_head(head: torch.nn.Linear) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
    """The weight and bias of the model's LM head `head`, whole, read outside its forward pass, for the block.

    Sharding engines hold a parameter whole only around its module's forward pass. DeepSpeed ZeRO-3 leaves an empty
    tensor behind (gathered by TRL's `maybe_gather_lm_head_ctx`); FSDP2 a `DTensor` holding this process's rows of
    the vocabulary, when the head's group reshards after forward (`full_tensor()` all-gathers it). Either way the
    transient is the head's `(V, H)` weight, as in the forward pass itself. Both gathers are collective: every
    process enters the block once per loss computation.
    """
    with maybe_gather_lm_head_ctx(head.weight, head.bias):
        yield tuple(p.full_tensor() if isinstance(p, DTensor) else p for p in (head.weight, head.bias))


def lm_head_kept_logps(
    head: torch.nn.Linear,
    hidden: torch.Tensor,
    sampled_ids: torch.Tensor,
    sampled_logps: torch.Tensor,
    kept_ids: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """`topk_logps_from_hidden` with the weight and bias of the model's LM head `head` (`gathered_lm_head`: every
    process calls this once per loss computation), never `(B, T, V)` logits."""
    with gathered_lm_head(head) as (weight, bias):
        return topk_logps_from_hidden(hidden, weight, bias, sampled_ids, sampled_logps, kept_ids, temperature)
