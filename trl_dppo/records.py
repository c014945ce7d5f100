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


__all__ = ["ROW_BITS", "VOID_ID", "SamplerRecords", "tag_logps", "tagged_rows"]

# A kept-set slot with no token (the sampled token is already among the top K, or the token has no record)
VOID_ID = -1
# Rows of one generation batch are tagged in the low ROW_BITS bits of a float64 mantissa (float32 leaves 29 free)
ROW_BITS = 28
_ROW_MASK = (1 << ROW_BITS) - 1


def tag_logps(logps: torch.Tensor, first_row: int) -> torch.Tensor:
    """float32 log-probabilities `(N,)` as float64 values carrying rows `first_row .. first_row + N - 1`."""
    if first_row + logps.numel() >= _ROW_MASK:
        raise RuntimeError(f"More than {_ROW_MASK - 1} sampled tokens in one generation batch cannot be tagged.")
    values = logps.detach().to(device="cpu", dtype=torch.float32).double()
    bits = values.view(torch.int64) | torch.arange(first_row + 1, first_row + 1 + values.numel(), dtype=torch.int64)
    return torch.where(torch.isinf(values), values, bits.view(torch.float64))


def tagged_rows(logprobs: list[list[float]], length: int) -> torch.Tensor:
    """The store rows `(B, length)` carried by TRL's per-completion float lists; -1 where a token carries none."""
    lengths = torch.tensor([len(row) for row in logprobs], dtype=torch.long)
    count = int(lengths.sum())
    try:
        values = np.fromiter(itertools.chain.from_iterable(logprobs), dtype=np.float64, count=count)
    except TypeError:  # vLLM reports a NaN log-prob as None; it carries no row
        flat = itertools.chain.from_iterable(logprobs)
        values = np.fromiter((math.nan if v is None else v for v in flat), dtype=np.float64, count=count)
    rows = torch.full((len(logprobs), length), -1, dtype=torch.long)
    rows[torch.arange(length) < lengths[:, None]] = (torch.from_numpy(values).view(torch.int64) & _ROW_MASK) - 1
    return rows


@dataclass
class SamplerRecords:
    """What the sampler recorded for the tokens of one generation batch, beyond the float TRL keeps.

    Rows are appended per backend call (`add`) and read back per batch token through the tags (`batch_tensors`).

    - `kept_ids` / `kept_logps` `(N, K + 1)`: the sampler's K most likely tokens and their log-probabilities (top-K
      only), and a last slot left empty, filled per batch token with the sampled token when outside the top K;
    - `base_logps` `(N,)`: log mu_base of the sampled token, log_softmax(logits / T) before any truncation or
      penalty, stored only when the sampler's chain did more than temperature (the trainer's pi is that
      distribution, so the divergence compares like with like). The top-K is then taken under mu_base too.

    `rollout_logprobs` holds GRPOTrainer's float lists after its tool-call stitching, for `batch_tensors`.
    """

    topk: int = 0
    rows: int = 0
    _sampled: list[torch.Tensor] = field(default_factory=list)
    _kept_ids: list[torch.Tensor] = field(default_factory=list)
    _kept_logps: list[torch.Tensor] = field(default_factory=list)
    _base: list[torch.Tensor | None] = field(default_factory=list)
    rollout_logprobs: list[list[float]] | None = None

    def add(
        self,
        sampled_logps: torch.Tensor,
        top_ids: torch.Tensor | None = None,
        top_logps: torch.Tensor | None = None,
        base_logps: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Store one backend call's records `(N, ...)`; returns the sampled log-probabilities tagged with rows."""
        tagged = tag_logps(sampled_logps, self.rows)
        self._sampled.append(sampled_logps.detach().float().cpu())
        if self.topk:
            n = sampled_logps.numel()
            ids = torch.full((n, self.topk + 1), VOID_ID, dtype=torch.int32)
            ids[:, : self.topk] = top_ids
            logps = torch.full((n, self.topk + 1), -math.inf)
            logps[:, : self.topk] = top_logps
            self._kept_ids.append(ids)
            self._kept_logps.append(logps)
        self._base.append(None if base_logps is None else base_logps.detach().float().cpu())
        self.rows += sampled_logps.numel()
        return tagged

    @property
    def has_base(self) -> bool:
        return any(b is not None for b in self._base)

    @property
    def needed(self) -> bool:
        """Whether the batch needs anything beyond `sampling_per_token_logps` (else tokens need carry no row)."""
        return bool(self.topk) or self.has_base

    def batch_tensors(self, completion_ids: torch.Tensor, sampling_logps: torch.Tensor) -> dict[str, torch.Tensor]:
        """The batch keys for the trainer, aligned with `completion_ids` `(B, T)`.

        `sampler_kept_ids` `(B, T, K + 1)` int32 and `sampler_kept_logps` `(B, T, K + 1)` float32: the top-K, then the
        sampled token when it is not among them (else an empty slot, id -1 and log-prob -inf); `sampler_base_logps`
        `(B, T)` when mu_base was recorded. Tokens without a row (tool results, padding) get empty slots.
        """
        if not self.needed:
            return {}
        device = completion_ids.device
        if self.rows:  # else a custom rollout produced the batch: its floats carry no rows
            if self.rollout_logprobs is None:
                raise RuntimeError("The generation batch's log-probability lists were not kept; `_generate` does.")
            rows = tagged_rows(self.rollout_logprobs, completion_ids.size(1))
            if rows.max().item() >= self.rows:
                raise RuntimeError("A log-probability carries a row this generation batch never recorded.")
        else:
            rows = torch.full(completion_ids.shape, -1, dtype=torch.long)
        has_row = rows >= 0
        index = rows.clamp_min(0)
        out = {}
        if self.has_base:
            base = _concat([s if b is None else b for s, b in zip(self._sampled, self._base, strict=True)])[index]
            base = torch.where(has_row, base, sampling_logps.cpu())
            out["sampler_base_logps"] = base.to(device)
            sampled_logps = base
        else:
            sampled_logps = sampling_logps.cpu()
        if self.topk:
            if self.rows:  # each part of the store is released once gathered: it is not read again
                ids = _concat(self._kept_ids)[index]
                self._kept_ids.clear()
                logps = _concat(self._kept_logps)[index]
                self._kept_logps.clear()
            else:
                ids = torch.empty(*rows.shape, self.topk + 1, dtype=torch.int32)
                logps = torch.empty(*rows.shape, self.topk + 1)
            ids.masked_fill_(~has_row[..., None], VOID_ID)
            logps.masked_fill_(~has_row[..., None], -math.inf)
            tokens = completion_ids.cpu()
            extra = ~(ids[..., : self.topk] == tokens[..., None]).any(-1) & has_row
            ids[..., self.topk][extra] = tokens[extra].int()
            logps[..., self.topk][extra] = sampled_logps.float()[extra]
            out["sampler_kept_ids"], out["sampler_kept_logps"] = ids.to(device), logps.to(device)
        return out


def _concat(chunks: list[torch.Tensor]) -> torch.Tensor:
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks)
