"""The sampler's records of one generation batch, kept in tensors and tied to tokens through TRL's float lists.

GRPOTrainer threads the sampler's per-token log-probabilities through its rollout code as Python floats in lists: it
stitches tool calls (`logprobs += [0.0] * tool_len + post_tool`), truncates with slices and finally pads them into the
float32 tensor `sampling_per_token_logps`. DPPO needs more per token (the sampler's top-K for the top-K divergence,
the untruncated log mu for truncated sampling), and one Python object per token costs hundreds of bytes and
microseconds. So the extra records live in one `SamplerRecords` per generation batch, as tensors built in one
vectorised pass per backend call, and each float handed to TRL carries its token's row in that store:

A sampled log-probability is a float32 value, so as a Python float (float64) the low 29 bits of its mantissa are zero.
`tag_logps` writes row + 1 into the low 28 of them. Rounding to float32 drops those bits exactly (they weigh less than
half a float32 unit in the last place, subnormals and 0.0 included, and NaN stays NaN), so `sampling_per_token_logps`
is bit for bit what it would be untagged, while the stitched and truncated lists still say which row each token came
from; 0 means none (tool-result tokens are 0.0, padding is absent). -inf cannot carry a row (its mantissa must stay
zero); such a token has no sampler probability and already leaves the loss.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np
import torch


__all__ = ["ROW_BITS", "VOID_ID", "SamplerRecords", "complete_kept_sets_", "tag_logps", "tagged_rows"]

# A kept-set slot with no token (the sampled token is already among the top K, or the token has no record)
VOID_ID = -1
# Rows of one generation batch are tagged in the low ROW_BITS bits of a float64 mantissa (float32 leaves 29 free)
ROW_BITS = 28
_ROW_MASK = (1 << ROW_BITS) - 1


def tag_logps(logps: torch.Tensor, first_row: int) -> torch.Tensor:
    """float32 log-probabilities `(N,)` as float64 values carrying rows `first_row .. first_row + N - 1`."""
    if first_row + logps.numel() >= _ROW_MASK:
        raise RuntimeError(f"More than {_ROW_MASK - 1} sampled tokens in one generation batch cannot be tagged.")
    logps = logps.detach().to(device="cpu", dtype=torch.float32)
    values = logps.double()
    values.view(torch.int64).bitwise_or_(torch.arange(first_row + 1, first_row + 1 + values.numel()))
    infinite = torch.isinf(logps)
    values[infinite] = logps[infinite].double()
    return values


def tagged_rows(logprobs: list[list[float]], length: int) -> torch.Tensor:
    """The store rows `(B, length)` carried by TRL's per-completion float lists; -1 where a token carries none."""
    lengths = torch.tensor([len(row) for row in logprobs], dtype=torch.long)
    count = int(lengths.sum())
    try:
        values = np.fromiter(itertools.chain.from_iterable(logprobs), dtype=np.float64, count=count)
    except TypeError:  # vLLM reports a NaN log-prob as None; it carries no row
        flat = itertools.chain.from_iterable(logprobs)
        values = np.fromiter((math.nan if v is None else v for v in flat), dtype=np.float64, count=count)
    tagged = torch.from_numpy(values).view(torch.int64)
    tagged.bitwise_and_(_ROW_MASK).sub_(1)
    rows = torch.full((len(logprobs), length), -1, dtype=torch.long)
    rows[torch.arange(length) < lengths[:, None]] = tagged
    return rows


def complete_kept_sets_(
    kept_ids: torch.Tensor, kept_logps: torch.Tensor, sampled_ids: torch.Tensor, sampled_logps: torch.Tensor
) -> None:
    """Fill the last slot of kept sets `(..., K + 1)` whose first K slots hold the sampler's top K, in place.

    The last slot takes the sampled token `(...)` and its log-probability `(...)` when it is outside the top K, and is
    left empty (id `VOID_ID`, log-prob -inf) when it is among them.
    """
    topk = kept_ids.size(-1) - 1
    outside = torch.ones(sampled_ids.shape, dtype=torch.bool, device=sampled_ids.device)
    for slot in range(topk):  # a column at a time: no (..., K) transient beside the records
        outside &= kept_ids[..., slot] != sampled_ids
    kept_ids[..., topk] = torch.where(outside, sampled_ids.to(kept_ids.dtype), VOID_ID)
    kept_logps[..., topk] = torch.where(outside, sampled_logps.to(kept_logps.dtype), -math.inf)


@dataclass
class _Block:
    """One backend call's records, laid out `(sequences, L, ...)` like a padded batch: row = first_row + s * L + t."""

    first_row: int
    sampled: torch.Tensor  # (S, L) float32
    kept_ids: torch.Tensor | None  # (S, L, K + 1) int32
    kept_logps: torch.Tensor | None  # (S, L, K + 1) float32
    base: torch.Tensor | None  # (S, L) float32


@dataclass
class SamplerRecords:
    """What the sampler recorded for the tokens of one generation batch, beyond the float TRL keeps.

    Each backend call adds one block laid out like a padded batch `(sequences, L)` (`add`); the rows of its tokens are
    read back per batch token through the tags (`batch_tensors`). Per token, a block holds:

    - `kept_ids` / `kept_logps` `(K + 1)`: the sampler's kept set (`complete_kept_sets_`): its K most likely tokens
      and their log-probabilities, then the sampled token when outside them (top-K only);
    - `base`: log mu_base of the sampled token, log_softmax(logits / T) before any truncation or penalty, stored only
      when the sampler's chain did more than temperature (the trainer's pi is that distribution, so the divergence
      compares like with like). The top-K is then taken under mu_base too.

    When the batch is exactly one block in its own layout (one generation call, no tool calls: the usual case), the
    batch tensors are views of the block, so the records cost (K + 1) x 8 bytes per token once, not twice.
    `rollout_logprobs` holds GRPOTrainer's float lists after its tool-call stitching, for `batch_tensors`.
    """

    topk: int = 0
    rows: int = 0
    _blocks: list[_Block] = field(default_factory=list)
    rollout_logprobs: list[list[float]] | None = None

    def add(
        self,
        sampled_logps: torch.Tensor,
        kept_ids: torch.Tensor | None = None,
        kept_logps: torch.Tensor | None = None,
        base_logps: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Store one backend call's records, `(S, L)` per token (padded positions are never read back); returns the
        sampled log-probabilities `(S, L)` tagged with their rows."""
        if self.topk and (kept_ids is None or kept_ids.shape != (*sampled_logps.shape, self.topk + 1)):
            raise ValueError(
                f"Top-{self.topk} records need kept sets of shape {(*sampled_logps.shape, self.topk + 1)}."
            )
        tagged = tag_logps(sampled_logps.reshape(-1), self.rows).view(sampled_logps.shape)
        cpu = {"device": "cpu"}
        self._blocks.append(
            _Block(
                self.rows,
                sampled_logps.detach().to(**cpu, dtype=torch.float32),
                None if kept_ids is None else kept_ids.to(**cpu, dtype=torch.int32),
                None if kept_logps is None else kept_logps.to(**cpu, dtype=torch.float32),
                None if base_logps is None else base_logps.detach().to(**cpu, dtype=torch.float32),
            )
        )
        self.rows += sampled_logps.numel()
        return tagged

    @property
    def has_base(self) -> bool:
        return any(b.base is not None for b in self._blocks)

    @property
    def needed(self) -> bool:
        """Whether the batch needs anything beyond `sampling_per_token_logps` (else tokens need carry no row)."""
        return bool(self.topk) or self.has_base

    def batch_tensors(self, completion_ids: torch.Tensor, sampling_logps: torch.Tensor) -> dict[str, torch.Tensor]:
        """The batch keys for the trainer, aligned with `completion_ids` `(B, T)`; consumes the store.

        `sampler_kept_ids` `(B, T, K + 1)` int32 and `sampler_kept_logps` `(B, T, K + 1)` float32: the kept sets;
        `sampler_base_logps` `(B, T)` when mu_base was recorded. Tokens without a row (tool results, padding) get empty
        kept sets, and their own `sampling_logps` as base.
        """
        if not self.needed:
            return {}
        B, T = completion_ids.shape
        if self.rows:  # else a custom rollout produced the batch: its floats carry no rows
            if self.rollout_logprobs is None:
                raise RuntimeError("The generation batch's log-probability lists were not kept; `_generate` does.")
            rows = tagged_rows(self.rollout_logprobs, T)
            if rows.max().item() >= self.rows:
                raise RuntimeError("A log-probability carries a row this generation batch never recorded.")
        else:
            rows = torch.full((B, T), -1, dtype=torch.long)
        no_row = rows < 0
        block = self._blocks[0] if len(self._blocks) == 1 else None
        if block is not None and _is_block_layout(rows, no_row, block):

            def take(key: str) -> torch.Tensor:  # a view of the block: no copy
                return getattr(block, key)[:, :T]

        else:
            index = rows.clamp_min(0).view(-1)

            def take(key: str) -> torch.Tensor:
                values = _concat(self._blocks, key)
                return values[index].view(B, T, *values.shape[1:])

        out = {}
        if self.has_base:
            base = take("base")
            out["sampler_base_logps"] = torch.where(no_row, sampling_logps.cpu(), base)
        if self.topk:
            ids, logps = take("kept_ids"), take("kept_logps")
            if no_row.any():
                ids.masked_fill_(no_row[..., None], VOID_ID)
                logps.masked_fill_(no_row[..., None], -math.inf)
            out["sampler_kept_ids"], out["sampler_kept_logps"] = ids, logps
        self._blocks.clear()
        return {key: value.to(completion_ids.device) for key, value in out.items()}


def _is_block_layout(rows: torch.Tensor, no_row: torch.Tensor, block: _Block) -> bool:
    """Whether batch token (b, t) has row first_row + b * L + t wherever it has one (one call, no tool calls)."""
    S, L = block.sampled.shape
    B, T = rows.shape
    if S != B or T > L:
        return False
    # In place on `rows` and undone after: no (B, T) int64 transient beside the store
    offsets = block.first_row + torch.arange(B)[:, None] * L
    rows.sub_(offsets).sub_(torch.arange(T))
    aligned = bool(((rows == 0) | no_row).all())
    rows.add_(torch.arange(T)).add_(offsets)
    return aligned


def _concat(blocks: list[_Block], key: str) -> torch.Tensor:
    """The blocks' `key` records, one per row `(rows, ...)`; a block without base records gives its sampled ones."""
    parts = []
    for block in blocks:
        value = getattr(block, key)
        if value is None:  # only `base` can be missing from some blocks
            value = block.sampled
        parts.append(value.reshape(-1, *value.shape[2:]))
    return parts[0] if len(parts) == 1 else torch.cat(parts)
