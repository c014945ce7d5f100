"""HH-RLHF prompts and a sequence-classification reward model for DPPO, with clear errors for wrong inputs.

Anthropic's HH-RLHF rows hold two full dialogues, ``chosen`` and ``rejected``, written as
``"\\n\\nHuman: ...\\n\\nAssistant: ..."`` turns that differ only in the last Assistant reply. The dialogue up to that
reply is the prompt; the policy writes a new reply, and a reward model scores the whole conversation.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from datasets import Dataset, load_dataset
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)


__all__ = [
    "HH_PLAIN_TEMPLATE",
    "REWARD_MODEL_HINT",
    "hh_prompt_messages",
    "load_hh_prompts",
    "load_policy_tokenizer",
    "load_reward_model",
    "parse_hh_dialogue",
]

_TURN = re.compile(r"\n\n(Human|Assistant):[ ]?")
_ROLES = {"Human": "user", "Assistant": "assistant"}

REWARD_MODEL_HINT = (
    "Pass --reward_model_name_or_path with a hub id or a local folder of a sequence-classification reward model with "
    "one output (e.g. Skywork/Skywork-Reward-Llama-3.1-8B-v0.2, the paper's)."
)

# Renders a conversation the way HH-RLHF writes it, for reward models whose tokenizer has no chat template.
HH_PLAIN_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '\n\nHuman: ' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ '\n\nAssistant: ' + message['content'] }}"
    "{% else %}{{ message['content'] + '\n\n' }}{% endif %}"
    "{% endfor %}"
)


def parse_hh_dialogue(text: str) -> list[dict[str, str]]:
    """Split an HH-RLHF dialogue into ``{"role", "content"}`` turns; consecutive turns of one role are merged."""
    parts = _TURN.split(text if text.startswith("\n\n") else "\n\n" + text)
    messages: list[dict[str, str]] = []
    # parts = [text before the first marker, role, content, role, content, ...]
    for speaker, content in zip(parts[1::2], parts[2::2], strict=True):
        role, content = _ROLES[speaker], content.strip()
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"] = f"{messages[-1]['content']}\n\n{content}".strip()
        else:
            messages.append({"role": role, "content": content})
    return messages


def hh_prompt_messages(chosen: str) -> list[dict[str, str]] | None:
    """The conversation before the final Assistant reply, ending with a user turn; ``None`` for malformed rows."""
    messages = parse_hh_dialogue(chosen)
    if len(messages) < 2 or messages[-1]["role"] != "assistant":
        return None
    prompt = messages[:-1]
    if prompt[-1]["role"] != "user" or not prompt[-1]["content"]:
        return None
    return prompt


def _read_rows(data_path: str | None, dataset_name: str, subset: str | None, split: str) -> Dataset:
    if data_path is not None:
        path = Path(data_path).expanduser()
        if not path.is_file():
            raise FileNotFoundError(
                f"HH-RLHF data file {str(path)!r} does not exist. Pass --data_path with a .jsonl or .jsonl.gz file "
                "whose lines hold 'chosen' and 'rejected' dialogues, or leave --data_path out to load "
                f"--dataset_name {dataset_name} (--dataset_subset {subset}) from the hub."
            )
        return load_dataset("json", data_files=str(path), split="train")
    try:
        return load_dataset(dataset_name, data_dir=subset, split=split)
    except Exception as error:  # offline, unknown name, unknown subset...
        offline = " (HF_HUB_OFFLINE is set)" if os.environ.get("HF_HUB_OFFLINE") == "1" else ""
        raise ValueError(
            f"Could not load {dataset_name!r} (subset {subset!r}, split {split!r}) from the hub{offline}: {error}. "
            "Pass --data_path with a local .jsonl/.jsonl.gz copy of the HH-RLHF rows, or a reachable --dataset_name."
        ) from error


def load_hh_prompts(
    data_path: str | None = None,
    dataset_name: str = "Anthropic/hh-rlhf",
    subset: str | None = "harmless-base",
    split: str = "train",
    tokenizer: PreTrainedTokenizerBase | None = None,
    max_prompt_length: int | None = None,
    num_examples: int | None = None,
) -> Dataset:
    """Conversational prompts from HH-RLHF rows, local (``data_path``) or from the hub.

    Args:
        data_path: A ``.jsonl`` / ``.jsonl.gz`` file of rows with ``chosen`` and ``rejected``; overrides the hub.
        dataset_name: Hub id, read when ``data_path`` is ``None``.
        subset: Folder of the hub data set (``harmless-base``, ``helpful-base``, ...); ``None`` for all of them.
        split: Hub split.
        tokenizer: The policy's tokenizer; with ``max_prompt_length``, prompts whose chat-formatted length exceeds it
            are dropped (GRPO does not truncate prompts, and a cut dialogue is not a dialogue).
        max_prompt_length: Longest prompt kept, in tokens.
        num_examples: Keep at most this many rows (the first ones), before the length filter.

    Returns:
        A ``Dataset`` with a single ``prompt`` column of message lists.
    """
    rows = _read_rows(data_path, dataset_name, subset, split)
    if "chosen" not in rows.column_names:
        raise ValueError(
            f"HH-RLHF rows need a 'chosen' column (with 'rejected' beside it); got columns {rows.column_names}."
        )
    if num_examples is not None:
        rows = rows.select(range(min(num_examples, len(rows))))
    prompts = [p for p in (hh_prompt_messages(text) for text in rows["chosen"]) if p is not None]
    if tokenizer is not None and max_prompt_length is not None:
        prompts = [
            p
            for p in prompts
            if len(tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False))
            <= max_prompt_length
        ]
    if not prompts:
        raise ValueError("No usable HH-RLHF prompt: every row was malformed or longer than max_prompt_length.")
    return Dataset.from_dict({"prompt": prompts})


def load_policy_tokenizer(name_or_path: str, **kwargs: Any) -> PreTrainedTokenizerBase:
    """The policy's tokenizer (left padding and truncation, as GRPO wants); it must have a chat template."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, padding_side="left", truncation_side="left", **kwargs)
    except Exception as error:
        raise ValueError(
            f"Could not load the policy {name_or_path!r}: {error}. Pass --model_name_or_path with a hub id or a local "
            "folder of a chat model (e.g. Qwen/Qwen3-4B-Instruct-2507, or SmolLM2-135M-Instruct offline)."
        ) from error
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"The policy {name_or_path!r} has no chat template, but HH-RLHF prompts are conversations. Pass an "
            "instruct/chat model as --model_name_or_path (e.g. Qwen/Qwen3-4B-Instruct-2507, or SmolLM2-135M-Instruct "
            "offline), or add a chat_template to its tokenizer_config.json / chat_template.jinja."
        )
    return tokenizer


def load_reward_model(
    name_or_path: str | None, **model_kwargs: Any
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A sequence-classification reward model (one score) and its tokenizer, ready for GRPO's reward-model path.

    GRPO renders prompt + completion with the reward tokenizer's chat template; a tokenizer without one gets
    `HH_PLAIN_TEMPLATE`, which writes the conversation as HH-RLHF plain text ("\\n\\nHuman: ...\\n\\nAssistant: ...").
    """
    hint = REWARD_MODEL_HINT
    if not name_or_path:
        raise ValueError(f"No reward model given. {hint}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        model = AutoModelForSequenceClassification.from_pretrained(name_or_path, num_labels=1, **model_kwargs)
    except Exception as error:
        raise ValueError(f"Could not load the reward model {name_or_path!r}: {error}. {hint}") from error
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = HH_PLAIN_TEMPLATE
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id  # the score is read at the last non-pad token
    return model.eval(), tokenizer
