"""Verifiable arithmetic for the main job: procedurally generated sums and an exact-answer reward.

Each prompt asks for a small sum such as ``13 + 14`` and for the result alone, as a number; the reward reads the
*final* number of the reply, so a reply that rambles past its answer, or never gives one, earns nothing. The default
difficulty (two operands from 1 to 20, addition, a "calculator" system prompt) starts SmolLM2-135M-Instruct at about
15% exact answers when sampled at temperature 1.0 (it mostly talks around the sum), which leaves room to improve
within a short run: 100 steps of DPPO with LoRA bring it to about 45% on held-out prompts (80% training reward).
"""

from __future__ import annotations

import operator
import random
import re
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

from datasets import Dataset


__all__ = [
    "QUESTION_TEMPLATE",
    "SYSTEM_PROMPT",
    "arithmetic_dataset",
    "exact_answer_reward",
    "extract_final_number",
]

SYSTEM_PROMPT = "You are a calculator. Reply with only the resulting number."
QUESTION_TEMPLATE = "What is {expression}? Reply with only the final number."

_OPERATORS: dict[str, Callable[[int, int], int]] = {"+": operator.add, "-": operator.sub, "*": operator.mul}
# An optional minus sign not glued to a word or a number ("12-3" is 12 and 3, "-3" alone is minus three), then digits
# with optional thousands separators and an optional decimal part.
_NUMBER = re.compile(r"(?:(?<![\w.\-])-)?\d+(?:,\d{3})*(?:\.\d+)?")


def _evaluate(operands: Sequence[int], operators: Sequence[str]) -> int:
    """Evaluate with the usual precedence (``*`` before ``+``/``-``), left to right otherwise."""
    terms: list[int] = [operands[0]]
    signs: list[str] = []
    for op, value in zip(operators, operands[1:], strict=True):
        if op == "*":
            terms[-1] = terms[-1] * value
        else:
            signs.append(op)
            terms.append(value)
    result = terms[0]
    for op, value in zip(signs, terms[1:], strict=True):
        result = _OPERATORS[op](result, value)
    return result


def arithmetic_dataset(
    num_examples: int,
    seed: int = 0,
    *,
    num_operands: int = 2,
    min_value: int = 1,
    max_value: int = 20,
    operators: Sequence[str] = ("+",),
    allow_negative: bool = False,
    system_prompt: str | None = SYSTEM_PROMPT,
) -> Dataset:
    """Build a data set of arithmetic questions with exactly checkable answers.

    Args:
        num_examples: Number of rows.
        seed: Seed of the generator; the same arguments always give the same rows.
        num_operands: Operands per expression (at least 2).
        min_value: Smallest operand.
        max_value: Largest operand.
        operators: Operators to draw from, among ``"+"``, ``"-"`` and ``"*"``.
        allow_negative: Keep expressions whose result is negative (otherwise they are redrawn).
        system_prompt: System message put before the question; ``None`` leaves the chat template's default.

    Returns:
        A ``datasets.Dataset`` with a conversational ``prompt`` column (a list of ``{"role", "content"}`` messages, as
        TRL's GRPO expects) and an ``answer`` column holding the exact result as a string.
    """
    if num_operands < 2:
        raise ValueError(f"num_operands must be at least 2, got {num_operands}.")
    if min_value > max_value:
        raise ValueError(f"min_value ({min_value}) must not exceed max_value ({max_value}).")
    unknown = set(operators) - set(_OPERATORS)
    if not operators or unknown:
        raise ValueError(f"operators must be a non-empty subset of {sorted(_OPERATORS)}, got {list(operators)}.")
    rng = random.Random(seed)
    prompts: list[list[dict[str, str]]] = []
    answers: list[str] = []
    while len(answers) < num_examples:
        operands = [rng.randint(min_value, max_value) for _ in range(num_operands)]
        ops = [rng.choice(list(operators)) for _ in range(num_operands - 1)]
        result = _evaluate(operands, ops)
        if result < 0 and not allow_negative:
            continue
        expression = " ".join(
            [str(operands[0])] + [f"{op} {value}" for op, value in zip(ops, operands[1:], strict=True)]
        )
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": QUESTION_TEMPLATE.format(expression=expression)})
        prompts.append(messages)
        answers.append(str(result))
    return Dataset.from_dict({"prompt": prompts, "answer": answers})


def _completion_text(completion: Any) -> str:
    """The text of one completion, conversational (a list of messages) or plain (a string)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return str(completion.get("content") or "")
    if isinstance(completion, Sequence):
        # GRPO passes the generated turn(s) of a conversational prompt; the answer is in the last assistant turn.
        for message in reversed(completion):
            if isinstance(message, dict) and message.get("role", "assistant") == "assistant":
                content = message.get("content") or ""
                if isinstance(content, list):  # multimodal content blocks
                    content = " ".join(str(block.get("text", "")) for block in content if isinstance(block, dict))
                return str(content)
    return ""


def extract_final_number(text: str) -> Fraction | None:
    """The last number written in ``text``, or ``None`` if there is none.

    Understands a leading minus (``-7``, but not the dash of ``12-3``), thousands separators (``1,234``), decimals
    (``27.0`` is 27), and ignores surrounding markup such as ``**27**``, ``\\boxed{27}`` or a trailing full stop.
    """
    matches = _NUMBER.findall(text)
    if not matches:
        return None
    return Fraction(matches[-1].replace(",", ""))


def exact_answer_reward(completions: list[Any], answer: list[str], **kwargs: Any) -> list[float]:
    """1.0 for each completion whose final number equals the expected answer exactly, else 0.0.

    Signature of a TRL reward function: ``completions`` are the generated texts (or message lists) and ``answer`` is
    the data set's column of the same name.
    """
    rewards: list[float] = []
    for completion, expected in zip(completions, answer, strict=True):
        value = extract_final_number(_completion_text(completion))
        rewards.append(1.0 if value is not None and value == Fraction(str(expected)) else 0.0)
    return rewards
