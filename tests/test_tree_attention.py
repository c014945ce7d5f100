"""The exact PyTorch tree attention (`trl_dppo/tree_attention.py`) that stands in for TRL's CUDA kernel where it is
not available (a CPU, or a GPU without the `kernels` package or the hub).

TRL's `AsyncGRPOTrainer` packs a micro-batch into a prefix trie (`packing.TreeRow`): samples that share a prompt, or
the start of a reply, forward those tokens once. Whatever the packing, every loss term must get the log-probability
its sample gets alone under dense causal attention. The tests pack samples with TRL's own `TreeRow`, forward the row
with TRL's tree inputs, and compare with each sample forwarded alone with eager attention, all in float64 (TRL's
fused LM head computes in float32, so the tests read the model's own float64 logits).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from transformers import AttentionInterface, Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.masking_utils import AttentionMaskInterface, eager_mask
from transformers.models.llama.modeling_llama import repeat_kv
from trl.experimental.async_grpo.packing import TREE_ATTENTION, TreeRow

from trl_dppo.tree_attention import register_tree_attention_without_kernel


VOCAB = 64
# The reference: dense attention under transformers' own causal (and sliding-window) mask
DENSE = "dense_reference"
# float64 on both sides: the two differ only in the order of their sums (a few hundred terms per value at 1e-16
# relative each), far below this; attending to one wrong position moves a log-probability by 1e-2 or more
TOLERANCE = 1e-10


def llama() -> torch.nn.Module:
    """Grouped-query attention: 4 query heads read 2 key/value heads."""
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(config)


def gemma2() -> torch.nn.Module:
    """Soft-capped attention scores, and a sliding window of 4 tokens on every other layer."""
    config = Gemma2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        sliding_window=4,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=None,
        query_pre_attn_scalar=8,
    )
    return Gemma2ForCausalLM(config)


def samples_with_shared_prefixes(seed: int = 0) -> list[dict]:
    """Three prompts with four replies each: replies that share their first tokens, and two identical replies."""
    rng = random.Random(seed)
    samples = []
    for group in range(3):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(5, 9))]
        opening = [rng.randrange(VOCAB) for _ in range(3)]
        replies = [
            opening + [rng.randrange(VOCAB) for _ in range(rng.randint(2, 6))],
            opening + [rng.randrange(VOCAB) for _ in range(rng.randint(2, 6))],
            [rng.randrange(VOCAB) for _ in range(rng.randint(1, 8))],
        ]
        replies.append(list(replies[0]))
        for reply in replies:
            samples.append(
                {
                    "input_ids": np.array(prompt + reply),
                    "completion_mask": np.array([0] * len(prompt) + [1] * len(reply)),
                    "old_log_probs": np.zeros(len(prompt) + len(reply), dtype=np.float32),
                    "advantage": 1.0,
                    "group_id": group,
                }
            )
    return samples


def packed_log_probs(model: torch.nn.Module, samples: list[dict]) -> tuple[torch.Tensor, dict]:
    """Each loss term's log-probability from one forward of the packed row, at the position TRL's `compute_loss`
    reads it from (`token_index`), of the token it scores (`shift_labels`)."""
    row = TreeRow()
    for sample in samples:
        row.add(sample)
    packed = row.pack()
    model.config._attn_implementation = TREE_ATTENTION
    logits = model(
        input_ids=packed["input_ids"][None],
        position_ids=packed["position_ids"][None],
        tree_kv_index=packed["tree_kv_index"],
        tree_cu_seqlens_q=packed["tree_cu_seqlens_q"],
        tree_cu_seqlens_k=packed["tree_cu_seqlens_k"],
        tree_max_seqlen_q=int(packed["tree_max_seqlens"][0]),
        tree_max_seqlen_k=int(packed["tree_max_seqlens"][1]),
    ).logits[0]
    labels = packed["shift_labels"][packed["token_index"]]
    return logits[packed["token_index"]].log_softmax(-1).gather(-1, labels[:, None])[:, 0], packed


def dense_attention(module, query, key, value, attention_mask, scaling, sliding_window=None, softcap=None, **kwargs):
    """Eager attention (transformers' `eager_attention_forward`, with Gemma 2's soft cap) with its softmax in the
    inputs' precision: eager takes it in float32, which would cap a float64 comparison at float32's."""
    key, value = repeat_kv(key, module.num_key_value_groups), repeat_kv(value, module.num_key_value_groups)
    scores = query @ key.transpose(2, 3) * scaling
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    probs = torch.softmax(scores + attention_mask, dim=-1)  # the mask holds the causal and sliding-window limits
    return (probs @ value).transpose(1, 2).contiguous(), probs


def dense_log_probs(model: torch.nn.Module, samples: list[dict]) -> torch.Tensor:
    """The same terms, each sample forwarded alone with dense causal attention, in `pack`'s order of terms."""
    model.config._attn_implementation = DENSE
    terms = []
    for sample in samples:
        ids = torch.tensor(sample["input_ids"])[None]
        logps = model(input_ids=ids).logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
        terms.append(logps[torch.tensor(sample["completion_mask"][1:], dtype=torch.bool)])
    return torch.cat(terms)


@pytest.fixture(autouse=True)
def attention_functions():
    register_tree_attention_without_kernel(TREE_ATTENTION, torch.device("cpu"))
    AttentionInterface.register(DENSE, dense_attention)
    AttentionMaskInterface.register(DENSE, eager_mask)


@pytest.mark.parametrize("build", [llama, gemma2])
@torch.no_grad()
def test_packed_tree_attention_gives_every_sample_its_dense_causal_log_probs(build):
    torch.manual_seed(0)
    model = build().double().eval()
    samples = samples_with_shared_prefixes()
    packed, row = packed_log_probs(model, samples)
    assert len(row["input_ids"]) < sum(len(s["input_ids"]) for s in samples)  # prefixes are shared...
    assert len(row["tree_cu_seqlens_q"]) - 1 > len(samples)  # ... and the trie branches inside replies
    dense = dense_log_probs(model, samples)
    assert packed.shape == dense.shape
    torch.testing.assert_close(packed, dense, rtol=0, atol=TOLERANCE)


@torch.no_grad()
def test_attending_across_branches_would_be_caught():
    """Plain causal attention over the packed row lets a reply see its siblings' tokens: the comparison fails."""
    torch.manual_seed(0)
    model = llama().double().eval()
    samples = samples_with_shared_prefixes()
    row = TreeRow()
    for sample in samples:
        row.add(sample)
    packed = row.pack()
    model.config._attn_implementation = DENSE
    # An all-ones mask: causal over the whole row (no packed-sequence detection from the position ids)
    ids = packed["input_ids"][None]
    logits = model(input_ids=ids, position_ids=packed["position_ids"][None], attention_mask=torch.ones_like(ids))
    labels = packed["shift_labels"][packed["token_index"]]
    causal = logits.logits[0, packed["token_index"]].log_softmax(-1).gather(-1, labels[:, None])[:, 0]
    assert (causal - dense_log_probs(model, samples)).abs().max() > 1e-2


def test_trls_kernel_stays_where_it_loads_and_pytorch_attends_elsewhere(monkeypatch):
    from trl.experimental.async_grpo import packing

    assert register_tree_attention_without_kernel(TREE_ATTENTION, torch.device("cpu"))
    monkeypatch.setattr(packing, "_flash_attn", lambda: object())  # the kernel loads
    assert not register_tree_attention_without_kernel(TREE_ATTENTION, torch.device("cuda"))

    def offline():
        raise OSError("the hub is unreachable")

    monkeypatch.setattr(packing, "_flash_attn", offline)
    with pytest.warns(UserWarning, match="could not be loaded \\(OSError: the hub is unreachable\\)"):
        assert register_tree_attention_without_kernel(TREE_ATTENTION, torch.device("cuda"))


def test_the_gradient_reaches_every_position_once():
    """Backward through the per-segment loop: the packed row's gradient equals the sum of the samples' dense ones."""
    torch.manual_seed(0)
    model = llama().double()
    samples = samples_with_shared_prefixes()
    packed_log_probs(model, samples)[0].sum().backward()
    tree_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    dense_log_probs(model, samples).sum().backward()
    for tree_grad, param in zip(tree_grads, model.parameters(), strict=True):
        # Llama's RMSNorm computes in float32 even in a float64 model, so a gradient summed over the samples that
        # share a position before the norm's backward (packed) rounds differently from one summed after (dense): at
        # float32's 1.2e-7 relative per position, over at most ~100 positions. A branch missing or counted twice
        # moves the gradient by a sizeable fraction of its largest entry.
        torch.testing.assert_close(tree_grad, param.grad, rtol=0, atol=1e-5 * param.grad.abs().max().item())
