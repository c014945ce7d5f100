"""Shared fixtures: tiny models built in the test session with SmolLM2's real tokenizer, and a small prompt set."""

from __future__ import annotations

import os


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch
from datasets import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

from trl_dppo.default_model import smollm2_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return smollm2_tokenizer()


def build_tiny_model(tokenizer, seed: int = 0, head_scale: float = 30.0, hidden_size: int = 32) -> LlamaForCausalLM:
    """A 2-layer Llama over SmolLM2's vocabulary.

    A random model spreads probability almost evenly over 49k tokens, so |pi - mu| would be tiny even for a
    misaligned mu; scaling the output layer makes its next-token distributions peaked, so misalignment shows.
    """
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    return model


@pytest.fixture(scope="session")
def tiny_model_dir(tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    build_tiny_model(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def prompts():
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Count to {i} and stop."}] for i in range(64)]})


def length_reward(completions, **kwargs):
    """A reward with spread within each group, so advantages are non-zero."""
    return [float(len(c[0]["content"]) % 5) for c in completions]


@pytest.fixture(scope="session")
def reward_model_dir(tokenizer, tmp_path_factory) -> str:
    """A tiny random sequence-classification Llama with one output and SmolLM2's tokenizer (chat template)."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-reward-model")
    LlamaForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def vllm_model_dir(tokenizer, tmp_path_factory):
    """vLLM's CPU attention needs a head dimension of 32 or more, so this tiny model is a little wider."""
    path = tmp_path_factory.mktemp("tiny-llama-vllm")
    model = build_tiny_model(tokenizer, hidden_size=256, head_scale=10.0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
