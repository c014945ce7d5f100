"""The sampler's records of one generation batch, kept in tensors and tied to tokens through TRL's float lists.

GRPOTrainer threads the sampler's per-token log-probabilities through its rollout code as Python floats in lists: it
stitches tool calls (`logprobs += [0.0] * tool_len + post_tool`), truncates with slices and finally pads them into the
float32 tensor `sampling_per_token_logps`. DPPO needs more per token (the sampler's top-K for the top-K divergence,
the untruncated log mu for truncated sampling), and one Python object per token costs hundreds of bytes and
microseconds. So the extra records live in one `SamplerRecords` per generation batch, as tensors filled by vectorised
passes over runs of about `RUN_TOKENS` tokens (`runs_of_sequences`: nothing batch-sized is made beside them), and
each float handed to TRL carries its token's row in that store:

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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch


__all__ = [
    "MissingRecordsError",
    "NO_ROUTE",
    "ROW_BITS",
    "RUN_TOKENS",
    "VOID_ID",
    "SamplerRecords",
    "complete_kept_sets_",
    "runs_of_sequences",
    "tag_logps",
    "tagged_lists",
    "tagged_rows",
]

# A batch position without a recorded route (padding, a token the sampler never forwarded): the trainer routes it
NO_ROUTE = -1
# A kept-set slot with no token (the sampled token is already among the top K, or the token has no record)
VOID_ID = -1
# Rows of one generation batch are tagged in the low ROW_BITS bits of a float64 mantissa (float32 leaves 29 free)
ROW_BITS = 28
_ROW_MASK = (1 << ROW_BITS) - 1
# Passes over a whole generation batch go this many tokens at a time, which bounds their transient memory
RUN_TOKENS = 1 << 12


class MissingRecordsError(RuntimeError):
    """A loss token of a generation batch that needs records resolves to none."""


def runs_of_sequences(count: int, length: int) -> Iterator[tuple[int, int]]:
    """`(start, end)` runs of `count` sequences padded to `length`: about `RUN_TOKENS` padded tokens a run, at least
    one sequence."""
    run = max(1, RUN_TOKENS // max(length, 1))
    for start in range(0, count, run):
        yield start, min(start + run, count)


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


def tagged_lists(logps: torch.Tensor, lengths: Sequence[int], first_row: int) -> Iterator[list[float]]:
    """Each sequence's log-probabilities `(S, L)`, cut to its length, as floats carrying rows `first_row + s * L + t`;
    tagged `RUN_TOKENS` at a time as the lists are taken."""
    S, L = logps.shape
    for start, end in runs_of_sequences(S, L):
        values = tag_logps(logps[start:end].reshape(-1), first_row + start * L).view(-1, L).tolist()
        for row, length in zip(values, lengths[start:end], strict=True):
            del row[length:]
            yield row


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
    left empty (id `VOID_ID`, log-prob -inf) when it is among them. Meant for a step or a run of tokens: it makes a
    `(..., K)` transient.
    """
    topk = kept_ids.size(-1) - 1
    outside = (kept_ids[..., :topk] != sampled_ids[..., None].to(kept_ids.dtype)).all(-1)
    kept_ids[..., topk] = torch.where(outside, sampled_ids.to(kept_ids.dtype), VOID_ID)
    kept_logps[..., topk] = torch.where(outside, sampled_logps.to(kept_logps.dtype), -math.inf)


@dataclass
class _Block:
    """One backend call's records, laid out `shape = (sequences, L)` like a padded batch: row first_row + s * L + t."""

    first_row: int
    shape: tuple[int, int]
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

    The sampled log-probability itself is not kept: TRL keeps it. When the batch is exactly one block in its own
    layout (one generation call, no tool calls: the usual case), the batch tensors are views of the block, so top-K
    records cost (K + 1) x 8 bytes per token once, not twice. `rollout_logprobs` holds GRPOTrainer's float lists after
    its tool-call stitching, for `batch_tensors`.
    """

    topk: int = 0
    rows: int = 0
    _blocks: list[_Block] = field(default_factory=list)
    rollout_logprobs: list[list[float]] | None = None
    # With router replay: per completion, in generation order, the tokens the sampler forwarded `(n,)` and the experts
    # it routed each of them to `(n, layers, k)` int16 (`moe.py`)
    routes: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # With `true_divergence_fraction`: per completion, in generation order, its tokens `(n,)` and, for the completions
    # chosen, log mu_base over the whole vocabulary at each of them `(n, V)` float32 on the CPU (else None)
    distributions: list[tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=list)

    def add(
        self,
        shape: tuple[int, int],
        kept_ids: torch.Tensor | None = None,
        kept_logps: torch.Tensor | None = None,
        base_logps: torch.Tensor | None = None,
    ) -> int:
        """Keep one backend call's records, laid out `shape = (S, L)` per token (positions past a sequence's length are
        never read back). The store keeps the tensors themselves, moved to the CPU: a caller on the CPU may still
        fill them. Returns the call's first row: token (s, t) has row first_row + s * L + t, which the sampled
        log-probabilities handed to TRL carry (`tagged_lists`)."""
        shape = tuple(shape)
        if self.topk and (kept_ids is None or kept_ids.shape != (*shape, self.topk + 1)):
            raise ValueError(f"Top-{self.topk} records need kept sets of shape {(*shape, self.topk + 1)}.")
        if self.rows + math.prod(shape) >= _ROW_MASK:
            raise RuntimeError(f"More than {_ROW_MASK - 1} sampled tokens in one generation batch cannot be tagged.")
        cpu = {"device": "cpu"}
        block = _Block(
            self.rows,
            shape,
            None if kept_ids is None else kept_ids.to(**cpu, dtype=torch.int32),
            None if kept_logps is None else kept_logps.to(**cpu, dtype=torch.float32),
            None if base_logps is None else base_logps.detach().to(**cpu, dtype=torch.float32),
        )
        self._blocks.append(block)
        self.rows += math.prod(shape)
        return block.first_row

    @property
    def has_base(self) -> bool:
        return any(b.base is not None for b in self._blocks)

    @property
    def needed(self) -> bool:
        """Whether the batch needs anything beyond `sampling_per_token_logps` (else tokens need carry no row)."""
        return bool(self.topk) or self.has_base

    def batch_tensors(
        self, completion_ids: torch.Tensor, sampling_logps: torch.Tensor, loss_mask: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """The batch keys for the trainer, aligned with `completion_ids` `(B, T)`; consumes the store.

        `sampler_kept_ids` `(B, T, K + 1)` int32 and `sampler_kept_logps` `(B, T, K + 1)` float32: the kept sets;
        `sampler_base_logps` `(B, T)` when mu_base was recorded. Tokens without a row (tool results, padding) get empty
        kept sets, and their own `sampling_logps` as base. Raises `MissingRecordsError` when a token of `loss_mask`
        `(B, T)` with a finite sampler log-probability has no row (tokens without one leave the loss anyway).
        """
        if not self.needed:
            return {}
        B, T = completion_ids.shape
        if self.rows and self.rollout_logprobs is None:
            raise RuntimeError("The generation batch's log-probability lists were not kept; `_generate` does.")
        # Without rows, a custom rollout produced the batch: its floats carry none
        logprobs = self.rollout_logprobs if self.rows else None
        keys = {"base": "sampler_base_logps"} if self.has_base else {}
        if self.topk:
            keys.update(kept_ids="sampler_kept_ids", kept_logps="sampler_kept_logps")
        block = self._blocks[0] if len(self._blocks) == 1 else None
        if logprobs is not None and block is not None and _in_block_layout(logprobs, block, T):
            out = {name: getattr(block, key)[:, :T] for key, name in keys.items()}  # views of the block: no copy
            row_runs = _row_runs(logprobs, T)  # read again, rather than keep a (B, T) mask from the check
        else:
            rows = torch.full((B, T), -1, dtype=torch.long) if logprobs is None else tagged_rows(logprobs, T)
            if rows.max().item() >= self.rows:
                raise RuntimeError("A log-probability carries a row this generation batch never recorded.")
            index = rows.clamp_min(0).view(-1)
            out = {}
            for key, name in keys.items():
                values = _concat(self._blocks, key)
                out[name] = values[index].view(B, T, *values.shape[1:])
            row_runs = [(0, rows)]
        sampling_logps = sampling_logps.cpu()
        loss_mask = loss_mask.cpu().bool()
        lost = 0
        for start, rows in row_runs:
            rowless = rows < 0
            end = start + rows.size(0)
            lost += int((rowless & loss_mask[start:end] & sampling_logps[start:end].isfinite()).sum())
            _clear_rowless_(out, rowless, sampling_logps, start)
        self._blocks.clear()
        if lost:
            raise MissingRecordsError(
                f"{lost} of the batch's {int(loss_mask.sum())} loss tokens carry no row of the sampler's records "
                f"({', '.join(keys.values())}): the row tags in the low mantissa bits of TRL's log-probability floats "
                "were lost between the sampler and the batch (a rollout path that rounds the floats to float32 or "
                "rebuilds them before tool calls are stitched). Without their records these tokens would read an "
                "empty kept set (a top-K divergence of 0, never masked) or the truncated mu as mu_base, so the batch "
                "stops here."
            )
        return {key: value.to(completion_ids.device) for key, value in out.items()}

    def add_routes(self, tokens: list[torch.Tensor], routes: list[torch.Tensor]) -> None:
        """Keep one generation call's routing records: per completion, the tokens the sampler forwarded `(n,)` (its
        prompt, then its completion but the last token) and the experts of each in every MoE layer `(n, layers, k)`."""
        for sequence, experts in zip(tokens, routes, strict=True):
            if sequence.numel() != experts.size(0):
                raise ValueError(f"{experts.size(0)} routes recorded for {sequence.numel()} tokens.")
            self.routes.append((sequence.to("cpu", torch.int64), experts.to("cpu", torch.int16)))

    def add_distributions(self, tokens: list[torch.Tensor], distributions: list[torch.Tensor | None]) -> None:
        """Keep one generation call's whole-vocabulary records: per completion, its tokens `(n,)` and log mu_base at
        each `(n, V)`, or None for a completion not chosen."""
        for sequence, logps in zip(tokens, distributions, strict=True):
            if logps is not None and logps.size(0) != sequence.numel():
                raise ValueError(f"{logps.size(0)} distributions recorded for {sequence.numel()} tokens.")
            self.distributions.append((sequence.to("cpu", torch.int64), None if logps is None else logps.cpu()))

    def batch_distributions(self, completion_ids: torch.Tensor) -> list[torch.Tensor | None]:
        """Per completion of the batch `(B, T)`, its recorded log mu_base `(n, V)` over its first n tokens, or None;
        consumes them. A list of B, which GRPOTrainer's shuffles and splits carry with the batch, so the records are
        freed with the batch at the next generation. Raises `MissingRecordsError` unless each completion has a record
        made for its own tokens."""
        B = completion_ids.size(0)
        if len(self.distributions) != B:
            raise MissingRecordsError(
                f"{len(self.distributions)} whole-vocabulary records for the batch's {B} completions: "
                "true_divergence_fraction needs one per completion, made by one generation call each."
            )
        completion_ids = completion_ids.cpu()
        out = []
        for b, (tokens, logps) in enumerate(self.distributions):
            if not torch.equal(completion_ids[b, : tokens.numel()], tokens):
                raise MissingRecordsError(
                    f"The whole-vocabulary record of completion {b} of the batch was made for other tokens than the "
                    "batch's (a rollout path that reorders or rewrites completions after generation): comparing it "
                    "with the trainer's distributions would measure another sequence."
                )
            out.append(logps)
        self.distributions = []
        return out

    def batch_routes(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor):
        """The routes `(B, P + C, layers, k)` int16 laid out like the batch's `cat(prompt_ids, completion_ids)`
        (prompts padded on the left, completions on the right), `NO_ROUTE` (-1) where none was recorded; consumes
        them. Raises `MissingRecordsError` unless each completion of the batch has a record, made for its own tokens."""
        B, P = prompt_ids.shape
        if len(self.routes) != B:
            raise MissingRecordsError(
                f"{len(self.routes)} routing records for the batch's {B} completions: router replay needs the "
                "sampler's routes of every completion, recorded by one generation call each."
            )
        layers, k = self.routes[0][1].shape[1:]
        out = torch.full((B, P + completion_ids.size(1), layers, k), NO_ROUTE, dtype=torch.int16)
        prompt_ids, completion_ids = prompt_ids.cpu(), completion_ids.cpu()
        starts = P - prompt_mask.sum(1).cpu()
        for b, (tokens, routes) in enumerate(self.routes):
            start = int(starts[b])
            sequence = torch.cat([prompt_ids[b, start:], completion_ids[b]])[: tokens.numel()]
            if not torch.equal(sequence, tokens):
                raise MissingRecordsError(
                    f"The routing record of completion {b} of the batch was made for other tokens than the batch's "
                    "(a rollout path that reorders or rewrites completions after generation): replaying it would route "
                    "tokens through another sequence's experts."
                )
            out[b, start : start + tokens.numel()] = routes
        self.routes = []
        return out


def _row_runs(logprobs: list[list[float]], length: int) -> Iterator[tuple[int, torch.Tensor]]:
    """The rows `(n, length)` of the batch tokens (`tagged_rows`), a run of `n` sequences from `start` at a time."""
    for start, end in runs_of_sequences(len(logprobs), length):
        yield start, tagged_rows(logprobs[start:end], length)


def _in_block_layout(logprobs: list[list[float]], block: _Block, length: int) -> bool:
    """Whether each batch token (b, t) that has a row has row first_row + b * L + t (one call, no tool calls)."""
    S, L = block.shape
    if S != len(logprobs) or length > L:
        return False
    for start, rows in _row_runs(logprobs, length):
        expected = block.first_row + torch.arange(start, start + rows.size(0))[:, None] * L + torch.arange(length)
        if not ((rows == expected) | (rows < 0)).all():
            return False
    return True


def _clear_rowless_(out: dict[str, torch.Tensor], rowless: torch.Tensor, sampling_logps: torch.Tensor, start: int):
    """Batch tokens `start ..` without a row (`rowless` `(n, T)`: tool results, padding) get empty kept sets and TRL's
    own float as base, in place; so does a base left NaN by a call that recorded none (its base is the sampled one)."""
    end = start + rowless.size(0)
    if "sampler_base_logps" in out:
        base = out["sampler_base_logps"][start:end]
        own = rowless | base.isnan()
        base[own] = sampling_logps[start:end][own]
    if "sampler_kept_ids" in out and rowless.any():
        out["sampler_kept_ids"][start:end].masked_fill_(rowless[..., None], VOID_ID)
        out["sampler_kept_logps"][start:end].masked_fill_(rowless[..., None], -math.inf)


def _concat(blocks: list[_Block], key: str) -> torch.Tensor:
    """The blocks' `key` records, one per row `(rows, ...)`; a block without base records gives NaN (see the caller)."""
    parts = []
    for block in blocks:
        value = getattr(block, key)
        if value is None:  # only `base` can be missing from some blocks
            value = torch.full(block.shape, math.nan)
        parts.append(value.reshape(-1, *value.shape[2:]))
    return parts[0] if len(parts) == 1 else torch.cat(parts)
