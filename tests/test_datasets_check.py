"""A training dataset the trainers cannot use is refused when the trainer is built, naming the problem, the row and
the fix (`trl_dppo/datasets_check.py`). Before, TRL failed at the first generation with `KeyError: 'prompt'` or, on
empty prompts, `IndexError: index -1 is out of bounds` inside transformers' generate."""

from __future__ import annotations

import warnings

import pytest
from datasets import Dataset, IterableDataset

from trl_dppo import AsyncDPPOConfig, AsyncDPPOTrainer
from trl_dppo.datasets_check import UnusableDatasetError, is_empty_prompt

from .conftest import NoWeightTransfer, StubRolloutWorker, length_reward, make_trainer


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def dppo(tmp_path, model_dir, tokenizer, dataset, **overrides):
    return make_trainer(tmp_path, model_dir, dataset, tokenizer, **overrides)


def async_dppo(tmp_path, model_dir, tokenizer, dataset):
    args = AsyncDPPOConfig(output_dir=str(tmp_path), report_to="none", bf16=False, token_budget=0)
    return AsyncDPPOTrainer(
        model_dir, length_reward, args, train_dataset=dataset, processing_class=tokenizer,
        rollout_worker=StubRolloutWorker(), weight_transfer=NoWeightTransfer(),
    )  # fmt: skip


BUILDERS = {"DPPOTrainer": dppo, "AsyncDPPOTrainer": async_dppo}


@pytest.mark.parametrize("trainer", BUILDERS)
def test_a_dataset_without_a_prompt_column_is_refused_naming_its_columns(trainer, tmp_path, tiny_model_dir, tokenizer):
    dataset = Dataset.from_dict({"question": ["Count to 3."] * 8, "answer": ["1 2 3"] * 8})
    with pytest.raises(UnusableDatasetError, match=r"no 'prompt' column \(its columns: \['question', 'answer'\]\)"):
        BUILDERS[trainer](tmp_path, tiny_model_dir, tokenizer, dataset)


# The row as the dataset returns it: datasets 4.7 (the oldest supported) gives a message's fields in name order, 5.x in
# the order they were written
EMPTY_CHAT_SHOWN = r"\[\{('role': 'user', 'content': ''|'content': '', 'role': 'user')\}\]"


@pytest.mark.parametrize("trainer", BUILDERS)
@pytest.mark.parametrize(
    ("empty", "shown"), [("", "''"), ("  \n", r"'  \\n'"), (chat(""), EMPTY_CHAT_SHOWN), (None, "None")]
)
def test_an_empty_prompt_is_refused_naming_its_row(trainer, empty, shown, tmp_path, tiny_model_dir, tokenizer):
    fine = "Count to 3." if isinstance(empty, str) else chat("Count to 3.")
    dataset = Dataset.from_list([{"prompt": fine}, {"prompt": fine}, {"prompt": empty}])
    with pytest.raises(
        UnusableDatasetError, match=f"Row 2 of {trainer}'s train_dataset has an empty prompt \\({shown}\\)"
    ):
        BUILDERS[trainer](tmp_path, tiny_model_dir, tokenizer, dataset)


def test_an_iterable_dataset_is_checked_from_its_first_rows(tmp_path, tiny_model_dir, tokenizer):
    def rows(key):
        for index in range(10_000):
            yield {key: f"Count to {index}."}

    with pytest.raises(UnusableDatasetError, match=r"its columns: \['text'\]"):
        dppo(tmp_path, tiny_model_dir, tokenizer, IterableDataset.from_generator(rows, gen_kwargs={"key": "text"}))
    dppo(tmp_path, tiny_model_dir, tokenizer, IterableDataset.from_generator(rows, gen_kwargs={"key": "prompt"}))


def test_a_prompt_of_padding_alone_is_refused(tmp_path, tiny_model_dir, tokenizer):
    dataset = Dataset.from_dict({"prompt": ["Count to 3."] * 3 + [tokenizer.pad_token * 4]})
    with pytest.raises(
        UnusableDatasetError, match=f"Row 3's prompt is 4 padding tokens \\(id {tokenizer.pad_token_id}\\)"
    ):
        dppo(tmp_path, tiny_model_dir, tokenizer, dataset)


def test_a_prompt_filling_the_models_positions_is_refused_and_one_near_them_warns(tmp_path, tiny_model_dir, tokenizer):
    """The tiny model has 512 positions, and transformers generation reads past them without an error."""
    words = lambda count: " ".join(["word"] * count)  # noqa: E731  one token per word
    assert len(tokenizer(words(600))["input_ids"]) == 600
    with pytest.raises(UnusableDatasetError, match="Row 1's prompt is 600 tokens, and the model has 512 positions"):
        dppo(tmp_path, tiny_model_dir, tokenizer, Dataset.from_dict({"prompt": ["Count to 3.", words(600)]}))
    with pytest.warns(UserWarning, match="Row 0's prompt is 505 tokens: with max_completion_length=10"):
        dppo(tmp_path, tiny_model_dir, tokenizer, Dataset.from_dict({"prompt": [words(505)]}))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Row .* tokens")
        dppo(tmp_path, tiny_model_dir, tokenizer, Dataset.from_dict({"prompt": [words(502)]}))


def test_a_prompt_with_an_image_and_no_text_is_not_empty():
    assert not is_empty_prompt([{"role": "user", "content": [{"type": "image"}]}])
    assert is_empty_prompt([{"role": "user", "content": [{"type": "text", "text": " "}]}])
    assert not is_empty_prompt([{"role": "system", "content": "Be brief."}, {"role": "user", "content": ""}])
