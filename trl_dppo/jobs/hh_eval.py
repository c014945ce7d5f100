"""How the HH pipeline measures a policy on held-out prompts: rewards, an independent judge, and collapse.

A policy is sampled as DPPO samples it (temperature 1, full distribution) on held-out prompts; each reply is scored
by the optimised reward model and by the judge (a second reward model trained on disjoint pairs, never trained
against); and the replies are measured for the ways a reward-hacked policy collapses: length and the share cut at the
limit, distinct-1/2 across replies, the policy's entropy, and its KL to the base model. A trained policy is compared
with the base on the same prompts by the judge's win rate, with a bootstrap interval over prompts.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from peft import PeftModel
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .hh_reward_model import score_conversations


__all__ = [
    "Replies",
    "bootstrap_interval",
    "distinct_n",
    "judge_comparison",
    "reply_measures",
    "sample_replies",
    "samples_section",
    "score_replies",
    "win_fractions",
]

Messages = list[dict[str, str]]
BOOTSTRAP_RESAMPLES = 10_000
_WORD = re.compile(r"\w+|[^\w\s]")  # words and punctuation marks, for distinct-n


@dataclass(frozen=True)
class Replies:
    """Sampled replies, ``[prompt][sample]``, with what the sampling policy assigned their tokens.

    A reply's tokens are those it generated up to and including its end-of-turn token; ``lengths`` counts those before
    it (a reply cut at the limit has none, and counts every token).
    """

    texts: list[list[str]]
    lengths: list[list[int]]
    cut: list[list[bool]]  # no end-of-turn token within the limit
    entropy: float  # the policy's mean next-token entropy over the replies' tokens (nats)
    kl_to_base: float | None  # mean log(pi / pi_base) over the replies' tokens: a per-token KL(pi || base) estimate


def _per_prompt(flat: Sequence, size: int) -> list[list]:
    return [list(flat[i : i + size]) for i in range(0, len(flat), size)]


@torch.no_grad()
def sample_replies(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Messages],
    num_samples: int,
    max_new_tokens: int,
    seed: int,
    *,
    kl_to_base: bool = False,
    batch_size: int = 16,
) -> Replies:
    """``num_samples`` replies per prompt, sampled as DPPO samples them (temperature 1, no top-k/top-p).

    The entropy is read from the logits generation samples from (no extra pass). With ``kl_to_base`` the model must be
    a LoRA (PEFT) model: the replies are scored once more with its adapters off, the base model.
    """
    if kl_to_base and not isinstance(model, PeftModel):
        raise ValueError(f"kl_to_base needs a PEFT model (adapters to switch off), got {type(model).__name__}.")
    torch.manual_seed(seed)
    texts, lengths, cut = [], [], []
    entropy_sum = log_ratio_sum = 0.0
    tokens = 0
    for start in range(0, len(prompts), batch_size):
        inputs = tokenizer.apply_chat_template(
            list(prompts[start : start + batch_size]),
            add_generation_prompt=True,
            padding=True,
            return_tensors="pt",
            return_dict=True,
            tokenizer_kwargs={"padding_side": "left"},  # replies continue the prompts: generation pads on the left
        ).to(model.device)
        output = model.generate(
            **inputs,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new_tokens,
            num_return_sequences=num_samples,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            return_dict_in_generate=True,
            output_logits=True,
        )
        completions = output.sequences[:, inputs["input_ids"].shape[1] :]
        is_eos = completions == tokenizer.eos_token_id
        # A reply's tokens: up to and including its first end-of-turn token (generation pads after it)
        mask = (is_eos.cumsum(1) - is_eos.long()) == 0
        # One step at a time: the logits of a whole batch are (rows, steps, vocabulary)
        entropies, policy_logps = [], []
        for step, logits in enumerate(output.logits):
            logps = logits.float().log_softmax(-1)
            entropies.append(-(logps.exp() * logps).sum(-1))
            policy_logps.append(logps.gather(-1, completions[:, step, None]).squeeze(-1))
        entropy_sum += (torch.stack(entropies, 1) * mask).sum().item()
        if kl_to_base:
            base_logps = _base_logps(model, inputs["attention_mask"], output.sequences, mask, num_samples)
            log_ratio_sum += ((torch.stack(policy_logps, 1) - base_logps) * mask).sum().item()
        tokens += mask.sum().item()
        ended = is_eos.any(1)
        texts += tokenizer.batch_decode(completions, skip_special_tokens=True)
        lengths += torch.where(ended, is_eos.long().argmax(1), completions.shape[1]).tolist()
        cut += (~ended).tolist()
    return Replies(
        texts=_per_prompt(texts, num_samples),
        lengths=_per_prompt(lengths, num_samples),
        cut=_per_prompt(cut, num_samples),
        entropy=entropy_sum / tokens,
        kl_to_base=log_ratio_sum / tokens if kl_to_base else None,
    )


def _base_logps(
    model: PeftModel, prompt_mask: torch.Tensor, sequences: torch.Tensor, reply_mask: torch.Tensor, num_samples: int
) -> torch.Tensor:
    """log pi_base of each generated token, the adapters off; a few rows at a time (the logits are vocabulary-wide)."""
    attention_mask = torch.cat([prompt_mask.repeat_interleave(num_samples, 0), reply_mask.long()], 1)
    # Positions as generate() numbers them under left padding, so the base sees the layout the policy sampled with
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    steps = reply_mask.shape[1]
    rows = []
    with model.disable_adapter():
        for i in range(0, len(sequences), 8):
            logits = model(
                input_ids=sequences[i : i + 8],
                attention_mask=attention_mask[i : i + 8],
                position_ids=position_ids[i : i + 8],
                logits_to_keep=steps + 1,
            ).logits[:, :-1]
            rows.append(logits.float().log_softmax(-1).gather(-1, sequences[i : i + 8, -steps:, None]).squeeze(-1))
    return torch.cat(rows)


def score_replies(
    reward_model: PreTrainedModel,
    reward_tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Messages],
    replies: Replies,
) -> list[list[float]]:
    """The reward model's score of every reply, per prompt (as GRPOTrainer scores them during DPPO)."""
    conversations = [
        p + [{"role": "assistant", "content": r}] for p, rs in zip(prompts, replies.texts, strict=True) for r in rs
    ]
    return _per_prompt(score_conversations(reward_model, reward_tokenizer, conversations), len(replies.texts[0]))


def distinct_n(texts: Sequence[str], n: int) -> float:
    """Distinct n-grams over all n-grams of the texts (words and punctuation, lower-cased; none across texts).

    1.0 when no n-gram repeats anywhere; near 0 when every reply says the same thing. 0.0 for texts with no n-gram.
    """
    grams = []
    for text in texts:
        words = _WORD.findall(text.lower())
        grams += [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def _flat(values: Sequence[Sequence]) -> list:
    return [v for row in values for v in row]


def reply_measures(replies: Replies, rewards: Sequence[Sequence[float]], judge: Sequence[Sequence[float]]) -> dict:
    """The held-out numbers of one policy: mean reward and judge score, length, cut share, distinct-n, entropy, KL."""
    texts = _flat(replies.texts)
    return {
        "reward": statistics.fmean(_flat(rewards)),
        "judge": statistics.fmean(_flat(judge)),
        "length": statistics.fmean(_flat(replies.lengths)),
        "cut_share": statistics.fmean(_flat(replies.cut)),
        "distinct_1": distinct_n(texts, 1),
        "distinct_2": distinct_n(texts, 2),
        "entropy": replies.entropy,
        "kl_to_base": replies.kl_to_base,
    }


def win_fractions(after: Sequence[Sequence[float]], before: Sequence[Sequence[float]]) -> list[float]:
    """Per prompt, the fraction of (after, before) reply pairs whose after-reply scores higher; a tie counts half."""
    return [
        statistics.fmean(1.0 if a > b else 0.5 if a == b else 0.0 for a in a_scores for b in b_scores)
        for a_scores, b_scores in zip(after, before, strict=True)
    ]


def bootstrap_interval(values: Sequence[float], level: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``values`` (one per prompt), resampling prompts.

    Prompts are the independent units: replies to one prompt are alike, so they are resampled together.
    """
    data = torch.tensor(values, dtype=torch.float64)
    generator = torch.Generator().manual_seed(seed)
    means = data[torch.randint(len(data), (BOOTSTRAP_RESAMPLES, len(data)), generator=generator)].mean(1)
    low, high = torch.quantile(means, torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64))
    return low.item(), high.item()


def judge_comparison(after: Sequence[Sequence[float]], before: Sequence[Sequence[float]]) -> dict:
    """The judge's verdict on after- against before-replies of the same prompts, with 95% intervals over prompts.

    ``win_rate``: the mean over prompts of `win_fractions` (0.5: no change). ``judge_change``: the mean over prompts
    of the change in mean judge score.
    """
    wins = win_fractions(after, before)
    changes = [statistics.fmean(a) - statistics.fmean(b) for a, b in zip(after, before, strict=True)]
    return {
        "win_rate": statistics.fmean(wins),
        "win_rate_ci95": bootstrap_interval(wins),
        "judge_change": statistics.fmean(changes),
        "judge_change_ci95": bootstrap_interval(changes),
    }


def _cell(text: str) -> str:
    return text.strip().replace("|", "\\|").replace("\n", "<br>") or "*(empty)*"


def samples_section(
    title: str,
    prompts: Sequence[Messages],
    before: Replies,
    after: Replies,
    before_scores: dict[str, Sequence[Sequence[float]]],
    after_scores: dict[str, Sequence[Sequence[float]]],
    count: int,
) -> tuple[str, dict[str, list[int]]]:
    """Markdown for one run: the ``count`` prompts whose judge change is nearest the median, then the most improved
    and the most worsened by the judge, each the base model's first reply beside the trained policy's.

    Returns the text and the prompts shown (indices into ``prompts``) by group.
    """
    changes = [
        statistics.fmean(a) - statistics.fmean(b)
        for a, b in zip(after_scores["judge"], before_scores["judge"], strict=True)
    ]
    median = statistics.median(changes)
    by_change = sorted(range(len(prompts)), key=changes.__getitem__)
    groups = {
        f"nearest the median judge change ({median:+.3f})": sorted(
            range(len(prompts)), key=lambda i: abs(changes[i] - median)
        )[:count],
        "most improved by the judge": by_change[-1:],
        "most worsened by the judge": by_change[:1],
    }

    def scores(of: dict, i: int) -> str:
        return f"reward {of['reward'][i][0]:+.2f}, judge {of['judge'][i][0]:+.2f}"

    lines = [f"## {title}", ""]
    for group, chosen in groups.items():
        lines += [f"### {group[0].upper()}{group[1:]}", ""]
        for i in chosen:
            prompt = prompts[i]
            context = f" ({len(prompt) - 1} earlier turns)" if len(prompt) > 1 else ""
            lines += [
                f"Prompt {i}{context}, judge change {changes[i]:+.2f}:",
                "",
                "> " + prompt[-1]["content"].strip().replace("\n", "\n> "),
                "",
                f"| base model ({scores(before_scores, i)}) | trained ({scores(after_scores, i)}) |",
                "|---|---|",
                f"| {_cell(before.texts[i][0])} | {_cell(after.texts[i][0])} |",
                "",
            ]
    return "\n".join(lines), {group.split(" (")[0]: chosen for group, chosen in groups.items()}
