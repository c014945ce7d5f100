"""Completions out of a packed batch: the layout the trust regions and corrections read, one row per completion.

`DPPOTrainer`'s batches already have it (GRPOTrainer pads one completion per row). TRL's asynchronous trainer packs
the completions of a micro-batch into one row per process and takes a flat list of loss terms over it, each with the
sample it belongs to (`segment_id`, within its row) and in the sample's token order (`packing._loss_terms`). A method
that reads positions or whole completions (CPPO, the sequence masks) needs them back as rows: `SequenceLayout` puts
each flat term at (its completion, its rank among that completion's terms) of a padded grid and reads results back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


__all__ = ["SequenceLayout"]


@dataclass(frozen=True)
class SequenceLayout:
    """Where each of N flat loss terms sits in a `(completions, longest)` grid."""

    row: torch.Tensor  # (N,) the completion of each term
    column: torch.Tensor  # (N,) its rank among its completion's terms, in their flat order
    shape: tuple[int, int]

    @classmethod
    def from_sequence_ids(cls, sequence_ids: torch.Tensor) -> SequenceLayout:
        """`sequence_ids` `(N,)`: one id per term, equal for the terms of one completion, which keep their order."""
        _, row = torch.unique(sequence_ids, return_inverse=True)
        counts = torch.bincount(row)
        order = torch.argsort(row, stable=True)
        starts = counts.cumsum(0) - counts
        column = torch.empty_like(row)
        column[order] = torch.arange(len(row), device=row.device) - starts[row[order]]
        # At least one (empty) slot: a process without loss terms runs the same code on a grid outside the loss
        return cls(row, column, (max(len(counts), 1), int(counts.max()) if len(counts) else 1))

    def to_grid(self, values: torch.Tensor, fill: float | bool) -> torch.Tensor:
        """`values` `(N,)` on the grid, `fill` where no term sits."""
        grid = values.new_full(self.shape, fill)
        grid[self.row, self.column] = values
        return grid

    def from_grid(self, grid: torch.Tensor) -> torch.Tensor:
        """The grid's values at the terms, `(N,)`, in their flat order."""
        return grid[self.row, self.column]
