"""Refuse, when a trainer is built, a training dataset it cannot use: what is wrong, in which row, and the fix.

TRL reads the prompts only when it first generates, and a dataset it cannot use fails there with a bare error: no
`prompt` column raises `KeyError: 'prompt'` (in AsyncDPPOTrainer, inside the rollout worker's process), empty prompts
`IndexError: index -1 is out of bounds for dimension 1 with size 0` inside transformers' `generate`. TRL 1.16 has no
`max_prompt_length` and never truncates a prompt: on transformers generation, a prompt longer than the model's
`max_position_embeddings` is read past the positions the model was trained on without an error (RoPE has no bound),
while vLLM refuses it itself ("longer than the maximum model length"), so only transformers generation is checked.

The checks read the first `CHECKED_ROWS` rows, so that a dataset of any size (or an `IterableDataset`, read from its
start as an epoch reads it) costs the same; with an `environment_factory` the environment's `reset()` supplies the
prompt, and nothing is checked.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterable
from typing import Any


__all__ = [
    "CHECKED_ROWS",
    "UnusableDatasetError",
    "check_prompt_lengths",
    "check_prompts",
    "first_prompt_rows",
    "is_empty_prompt",
]

# Rows checked from the start of the dataset: 1000 conversational prompts tokenize in well under a second
CHECKED_ROWS = 1000


class UnusableDatasetError(ValueError):
    """A training dataset the trainer cannot use, found when the trainer is built."""


def first_prompt_rows(dataset: Iterable, count: int = CHECKED_ROWS) -> tuple[list[str] | None, list[Any]]:
    """The dataset's column names (None where it does not know them) and its first `count` rows, of the `prompt`
    column alone where the dataset can select one (no other column, an image one say, is decoded)."""
    columns = getattr(dataset, "column_names", None)
    if columns and "prompt" in columns and hasattr(dataset, "select_columns"):
        dataset = dataset.select_columns(["prompt"])
    rows = list(itertools.islice(iter(dataset), count))
    if not columns and rows and isinstance(rows[0], dict):  # an IterableDataset may not know its columns
        columns = list(rows[0])
    return columns, rows


def is_empty_prompt(prompt: Any) -> bool:
    """Whether a prompt holds nothing to answer: a text prompt of whitespace only, or a conversation with no message
    whose content has text other than whitespace or a non-text part (an image)."""
    if isinstance(prompt, str):
        return not prompt.strip()
    if not isinstance(prompt, list):
        return False  # not a format this check knows; TRL's own errors apply
    for message in prompt:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str) and content.strip():
            return False
        if isinstance(content, list) and any(
            part.get("type") != "text" or (part.get("text") or "").strip()
            for part in content
            if isinstance(part, dict)
        ):
            return False
    return True


def check_prompts(columns: list[str] | None, rows: list[Any], trainer: str) -> None:
    """Refuse a dataset without a `prompt` column (naming the columns it has) or with an empty prompt (naming the
    row), from `first_prompt_rows`' answer."""
    if columns is not None and "prompt" not in columns:
        raise UnusableDatasetError(
            f"{trainer}'s train_dataset has no 'prompt' column (its columns: {columns}): the trainer generates from "
            "the 'prompt' of each row, as a string or a list of chat messages. Rename the column holding the prompts "
            "(dataset.rename_column('<name>', 'prompt')) or build one with dataset.map."
        )
    for index, row in enumerate(rows):
        if not isinstance(row, dict):
            return  # rows of another format (a torch Dataset's tuples, say): TRL's own errors apply
        prompt = row.get("prompt")
        if prompt is None or is_empty_prompt(prompt):
            what = (
                "transformers' generate fails on a prompt of no tokens with `IndexError: index -1 is out of bounds`"
                if isinstance(prompt, str)
                else "the model would be prompted with the chat template alone"
            )
            raise UnusableDatasetError(
                f"Row {index} of {trainer}'s train_dataset has an empty prompt ({prompt!r}): {what}. Drop such rows "
                "(dataset.filter) or fill them in."
            )


def check_prompt_lengths(
    prompt_ids: list[list[int]],
    pad_token_id: int | None,
    max_positions: int | None,
    max_completion_length: int | None,
) -> None:
    """Refuse a prompt of padding alone, or one that fills the model's `max_positions` (no position left for a
    completion); warn about one after which a completion of `max_completion_length` would run past them (`None`: the
    generation config's `max_length` bounds prompt and completion together, and there is nothing to warn about). The
    rows are the dataset's first, tokenized as the trainer tokenizes them."""
    warned = False
    for index, ids in enumerate(prompt_ids):
        if ids and pad_token_id is not None and all(token == pad_token_id for token in ids):
            raise UnusableDatasetError(
                f"Row {index}'s prompt is {len(ids)} padding tokens (id {pad_token_id}) and nothing else: TRL keeps "
                "every prompt token and attends to it, so the model would be prompted with padding. Was the dataset "
                "padded before it reached the trainer? Give the prompts unpadded."
            )
        if max_positions is None:
            continue
        if len(ids) >= max_positions:
            raise UnusableDatasetError(
                f"Row {index}'s prompt is {len(ids)} tokens, and the model has {max_positions} positions "
                "(max_position_embeddings): TRL 1.16 truncates no prompt, and transformers generation would read "
                "past the positions the model was trained on without an error. Filter or shorten the long prompts, "
                "e.g. dataset.filter(lambda row: len(tokenizer.apply_chat_template(row['prompt'])) < N)."
            )
        if max_completion_length is not None and len(ids) + max_completion_length > max_positions and not warned:
            warnings.warn(
                f"Row {index}'s prompt is {len(ids)} tokens: with max_completion_length={max_completion_length} a "
                f"completion can run past the model's {max_positions} positions (max_position_embeddings), which "
                "transformers generation does without an error. Lower max_completion_length or filter the long "
                "prompts.",
                UserWarning,
                stacklevel=4,
            )
            warned = True  # one warning says it
