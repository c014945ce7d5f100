"""A reward model for HH-RLHF: LoRA on a sequence-classification backbone, trained with TRL's RewardTrainer.

HH-RLHF rows are preference pairs (``chosen`` / ``rejected`` dialogues sharing everything but the last Assistant
reply). Here each row becomes ``{"prompt", "chosen", "rejected"}`` in TRL's conversational preference format, the rows
are split once, by a seed, into four disjoint parts (a held-out part nothing trains on, the pairs whose prompts DPPO
trains on, the judge's training pairs and the reward model's), and a reward model is trained on a part and saved
merged, as an ordinary one-output sequence-classification model that `trl_dppo.jobs.hh_rlhf.load_reward_model` (and so
``examples/hh_rlhf_lora.py --reward_model_name_or_path DIR``) loads. The judge is a second reward model, trained the
same way on its own part: the policy never trains against it, so it can say whether the optimised reward's gains are
real.

Scores are computed the way GRPOTrainer computes them during DPPO (conversation rendered with the reward tokenizer's
chat template, right padding, no special tokens added), so a held-out accuracy measured here is the accuracy of the
reward DPPO optimises.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForSequenceClassification, PreTrainedModel, PreTrainedTokenizerBase, set_seed
from trl import RewardConfig, RewardTrainer
from trl.data_utils import apply_chat_template

from .hh_rlhf import _read_rows, hh_prompt_messages, load_policy_tokenizer, load_reward_model, parse_hh_dialogue


__all__ = [
    "LORA_LINEAR_MODULES",
    "HHSplits",
    "load_hh_pairs",
    "pairwise_accuracy",
    "score_conversations",
    "split_hh_pairs",
    "train_hh_reward_model",
]

Messages = list[dict[str, str]]
# Llama-style projection names (SmolLM2, Llama, Qwen, Mistral); PEFT's `layers_to_transform` needs an explicit list
LORA_LINEAR_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
REWARD_TRAIN_LOG = "reward_log_history.json"


def _pair(chosen: str, rejected: str) -> dict[str, Messages] | None:
    """One HH row as a conversational preference pair; ``None`` when malformed or the two prompts differ."""
    prompt = hh_prompt_messages(chosen)
    rejected_messages = parse_hh_dialogue(rejected)
    if prompt is None or rejected_messages[:-1] != prompt or rejected_messages[-1]["role"] != "assistant":
        return None
    return {"prompt": prompt, "chosen": parse_hh_dialogue(chosen)[-1:], "rejected": rejected_messages[-1:]}


def _num_tokens(tokenizer: PreTrainedTokenizerBase, messages: Messages) -> int:
    return len(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False))


def load_hh_pairs(
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    data_path: str | None = None,
    dataset_name: str = "Anthropic/hh-rlhf",
    subset: str | None = "harmless-base",
    split: str = "train",
    num_rows: int | None = None,
) -> tuple[Dataset, int]:
    """HH-RLHF preference pairs whose chosen and rejected conversations both fit in ``max_length`` tokens.

    Pairs that do not fit are dropped rather than cut (a cut dialogue loses the reply being judged), so the reward
    model trains and is evaluated on what it will score during DPPO: prompts and replies within this length.

    Args:
        tokenizer: The reward model's tokenizer, whose chat template renders the conversations.
        max_length: Longest conversation kept, in tokens.
        data_path: A local ``.jsonl`` / ``.jsonl.gz`` file of rows with ``chosen`` and ``rejected``; overrides the hub.
        dataset_name, subset, split: The hub data set, read when ``data_path`` is ``None``.
        num_rows: Read at most this many rows (the first ones), e.g. to cap the hub's 42k-row train split.

    Returns:
        The pairs (columns ``prompt``, ``chosen``, ``rejected``) and the number of rows read.
    """
    rows = _read_rows(data_path, dataset_name, subset, split)
    missing = {"chosen", "rejected"} - set(rows.column_names)
    if missing:
        raise ValueError(f"HH-RLHF rows need 'chosen' and 'rejected' columns; missing {sorted(missing)}.")
    if num_rows is not None:
        rows = rows.select(range(min(num_rows, len(rows))))
    pairs = []
    for chosen, rejected in zip(rows["chosen"], rows["rejected"], strict=True):
        pair = _pair(chosen, rejected)
        if pair is not None and all(
            _num_tokens(tokenizer, pair["prompt"] + pair[side]) <= max_length for side in ("chosen", "rejected")
        ):
            pairs.append(pair)
    if not pairs:
        raise ValueError(f"No HH-RLHF pair fits in max_length={max_length} tokens; raise max_length.")
    return Dataset.from_list(pairs), len(rows)


@dataclass(frozen=True)
class HHSplits:
    """Disjoint parts of the pairs: the reward model trains on one, the judge on another, DPPO on a third's prompts,
    and nothing on held_out."""

    reward_train: Dataset
    judge_train: Dataset
    policy_train: Dataset
    held_out: Dataset

    def sizes(self) -> dict[str, int]:
        return {
            "reward_train": len(self.reward_train),
            "judge_train": len(self.judge_train),
            "policy_train": len(self.policy_train),
            "held_out": len(self.held_out),
        }


def split_hh_pairs(
    pairs: Dataset,
    held_out: int,
    policy_train: int,
    seed: int,
    judge_train: int | None = None,
    reward_train: int | None = None,
) -> HHSplits:
    """Shuffle the pairs with ``seed`` and cut them into held-out, policy, judge and reward-model parts, in that order.

    The held-out and policy parts are cut first, so they stay the same whatever the two reward models get;
    ``judge_train=None`` gives the judge half of the pairs left after them (rounded down), ``reward_train=None`` gives
    the reward model every pair left after the judge's.
    """
    left = len(pairs) - held_out - policy_train
    judge_train = left // 2 if judge_train is None else judge_train
    if judge_train < 1 or left - judge_train < 1 or (reward_train is not None and reward_train > left - judge_train):
        raise ValueError(
            f"held_out ({held_out}) + policy_train ({policy_train}) pairs leave {left} of the {len(pairs)} usable "
            f"pairs, which cannot give the judge {judge_train} and the reward model "
            f"{'the rest' if reward_train is None else reward_train} (each needs at least one); lower them, or raise "
            "max_length to keep more pairs."
        )
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    judge_start = held_out + policy_train
    rest = order[judge_start + judge_train :]
    return HHSplits(
        reward_train=pairs.select(rest if reward_train is None else rest[:reward_train]),
        judge_train=pairs.select(order[judge_start : judge_start + judge_train]),
        policy_train=pairs.select(order[held_out:judge_start]),
        held_out=pairs.select(order[:held_out]),
    )


@torch.no_grad()
def score_conversations(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, conversations: Sequence[Messages], batch_size: int = 16
) -> list[float]:
    """The reward model's score of each conversation, computed as GRPOTrainer computes it during DPPO."""
    texts = [apply_chat_template({"messages": list(c)}, tokenizer)["text"] for c in conversations]
    # Batches of similar lengths waste little on padding; scores go back in the input order
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    scores = [0.0] * len(texts)
    device = next(model.parameters()).device
    for start in range(0, len(order), batch_size):
        batch = order[start : start + batch_size]
        inputs = tokenizer(
            [texts[i] for i in batch],
            return_tensors="pt",
            padding=True,
            padding_side="right",
            add_special_tokens=False,
        ).to(device)
        for i, score in zip(batch, model(**inputs).logits[:, 0].float().tolist(), strict=True):
            scores[i] = score
    return scores


def pairwise_accuracy(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, pairs: Dataset, batch_size: int = 16
) -> dict[str, float]:
    """Fraction of pairs whose chosen reply scores above the rejected one, and the mean score margin."""
    chosen = score_conversations(
        model, tokenizer, [p + c for p, c in zip(pairs["prompt"], pairs["chosen"], strict=True)], batch_size
    )
    rejected = score_conversations(
        model, tokenizer, [p + r for p, r in zip(pairs["prompt"], pairs["rejected"], strict=True)], batch_size
    )
    margins = [c - r for c, r in zip(chosen, rejected, strict=True)]
    return {
        "accuracy": sum(m > 0 for m in margins) / len(margins),
        "mean_margin": sum(margins) / len(margins),
        "pairs": len(margins),
    }


def train_hh_reward_model(
    backbone: str,
    train_pairs: Dataset,
    output_dir: str | Path,
    eval_pairs: Dataset | None = None,
    *,
    max_length: int,
    seed: int = 0,
    learning_rate: float = 3e-4,
    batch_size: int = 8,
    num_train_epochs: float = 1.0,
    max_steps: int = -1,
    lora_r: int = 16,
    lora_top_layers: int | None = 8,
) -> dict[str, Any]:
    """Train a LoRA reward model on ``train_pairs`` with TRL's RewardTrainer and save it merged into ``output_dir``.

    Args:
        backbone: Local folder or hub id of a causal LM; it becomes a one-output sequence-classification model whose
            ``score`` head is new (seeded by ``seed``) and trained in full beside the LoRA adapters.
        train_pairs: Conversational pairs (``prompt``, ``chosen``, ``rejected``), e.g. a split's ``reward_train``.
        output_dir: Where the merged model and its tokenizer are saved.
        eval_pairs: Pairs never trained on; the summary then holds their accuracy before training (the untrained
            backbone with its seeded head) and after (the saved model, reloaded).
        max_length: Longest conversation in tokens (RewardTrainer drops longer pairs).
        lora_top_layers: Put LoRA only on the last this-many decoder layers (``None``: all of them). The backward
            pass then stops there, about halving a CPU step, and the top layers are where a new head's features form.

    Returns:
        A summary: steps, runtime, and the held-out accuracies when ``eval_pairs`` is given.
    """
    output_dir = Path(output_dir)
    start = time.time()
    tokenizer = load_policy_tokenizer(backbone)  # a chat template is required: the pairs are conversations
    tokenizer.padding_side = "right"
    set_seed(seed)  # the new score head's initial weights, for the baseline and the trainer alike
    model = AutoModelForSequenceClassification.from_pretrained(backbone, num_labels=1, dtype=torch.float32)
    model.config.pad_token_id = tokenizer.pad_token_id  # the score is read at the last non-pad token
    summary: dict[str, Any] = {"backbone": backbone, "train_pairs": len(train_pairs), "seed": seed}
    if eval_pairs is not None:
        summary["untrained"] = pairwise_accuracy(model.eval(), tokenizer, eval_pairs)
    num_layers = model.config.num_hidden_layers
    layers = None if lora_top_layers is None else list(range(max(0, num_layers - lora_top_layers), num_layers))
    peft_config = LoraConfig(
        task_type="SEQ_CLS",  # keeps the new `score` head trainable (modules_to_save) and saves it
        r=lora_r,
        lora_alpha=2 * lora_r,
        lora_dropout=0.0,
        target_modules=LORA_LINEAR_MODULES,
        layers_to_transform=layers,
    )
    cuda = torch.cuda.is_available()
    args = RewardConfig(
        output_dir=str(output_dir),
        max_length=max_length,
        learning_rate=learning_rate,
        per_device_train_batch_size=batch_size,
        num_train_epochs=num_train_epochs,
        max_steps=max_steps,
        lr_scheduler_type="cosine",
        warmup_steps=0.05,
        logging_steps=5,
        save_strategy="no",
        report_to="none",
        seed=seed,
        gradient_checkpointing=False,  # a 135M model needs no memory savings; recomputation costs CPU time
        bf16=cuda,
        use_cpu=not cuda,
        dataloader_num_workers=0,
    )
    trainer = RewardTrainer(
        model=model, args=args, train_dataset=train_pairs, processing_class=tokenizer, peft_config=peft_config
    )
    trainer.train()
    merged = trainer.model.merge_and_unload()
    output_dir.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    (output_dir / REWARD_TRAIN_LOG).write_text(json.dumps(trainer.state.log_history, indent=1))
    summary.update(
        steps=trainer.state.global_step,
        epochs=round(trainer.state.epoch, 3),  # below 1 when max_steps stops the pass early
        train_loss=trainer.state.log_history[-1].get("train_loss"),
        learning_rate=learning_rate,
        max_length=max_length,
        lora_r=lora_r,
        lora_layers=layers,
        runtime_s=round(time.time() - start, 1),
    )
    if eval_pairs is not None:
        # Through the loader of examples/hh_rlhf_lora.py: the accuracy is that of the folder DPPO will load
        saved, saved_tokenizer = load_reward_model(str(output_dir), dtype=torch.float32)
        summary["trained"] = pairwise_accuracy(saved, saved_tokenizer, eval_pairs)
    return summary
