"""Two processes (DDP over gloo) train the same DPPO update as one process, from the same global batch.

One prepared global generation batch (prompts, sampled completions, the sampler's log-probabilities and top-K kept
sets, advantages) is trained by `tests/equivalence_worker.py` once with `python` and once under
`accelerate launch --config_file examples/accelerate_configs/cpu_2proc.yaml`, each launch running every
configuration: binary and top-K, loss types dapo and grpo, LoRA and full fine-tuning, 2 optimizer steps from one
generation batch (steps_per_generation 2 and 4). The runs agree to float rounding, not bit for bit: two processes
add two partial sums where one process adds all terms at once, and DDP averages the two gradients; each update is the
difference of two float32 parameters. Seen on two CPUs: every difference of the updates was one ulp of the parameter
itself (1e-4 of a LoRA A update, which is 1e-3 of its weight), the logged metrics within 4e-7.

GRPOTrainer shuffles each process's generation batch before splitting it into micro-batches, which puts different
rows in each optimizer step for one and for two processes (an equally valid order); the worker holds the order fixed.
Loss types that normalise by a per-process count (`bnpo`: the mean over this process's tokens) are not equal across
process counts in GRPOTrainer itself and are not tested here; `dapo` normalises by the global token count and `grpo`
by equal per-process sequence counts, so both are.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trl_dppo import DPPOConfig, DPPOTrainer

from .conftest import TORCH_DISTRIBUTED_ENV, assert_updates_agree, launch, rendezvous_variables_restored
from .equivalence_worker import CONFIGS, TOPK, WORLD_ROWS


REPO = Path(__file__).resolve().parents[1]
VOCAB, PROMPT_LENGTH, COMPLETION_LENGTH = 512, 6, 8
MICRO_BATCHES = max(settings["steps_per_generation"] for settings in CONFIGS.values())


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=2,
        bos_token_id=1,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)  # peaked next-token distributions, so that |pi - mu| can exceed delta
    return model


@torch.no_grad()
def sampled_batch(model: LlamaForCausalLM, rows: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Completions sampled from a sampler whose logits are the model's plus noise, with its records, as a batch.

    The noise makes mu differ from the trainer's pi enough for DPPO's mask to act at delta 0.15.
    """
    generator = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(3, VOCAB, (rows, PROMPT_LENGTH), generator=generator)
    ids = prompt_ids
    sampled_logps, kept_ids, kept_logps = [], [], []
    for _ in range(COMPLETION_LENGTH):
        logits = model(ids).logits[:, -1].float()
        sampler = torch.log_softmax(logits + torch.randn(logits.shape, generator=generator), dim=-1)
        token = torch.multinomial(sampler.exp(), 1, generator=generator)
        logp = sampler.gather(-1, token)
        top_logps, top_ids = sampler.topk(TOPK, dim=-1)
        in_top = (top_ids == token).any(-1, keepdim=True)
        kept_ids.append(torch.cat([top_ids, torch.where(in_top, -1, token)], dim=-1))
        kept_logps.append(torch.cat([top_logps, torch.where(in_top, -float("inf"), logp)], dim=-1))
        sampled_logps.append(logp.squeeze(-1))
        ids = torch.cat([ids, token], dim=1)
    lengths = torch.randint(3, COMPLETION_LENGTH + 1, (rows,), generator=generator)
    completion_mask = (torch.arange(COMPLETION_LENGTH) < lengths[:, None]).long()
    pad = ~completion_mask.bool()
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": ids[:, PROMPT_LENGTH:].masked_fill(pad, 0),
        "completion_mask": completion_mask,
        "advantages": torch.randn(rows, generator=generator),
        "sampling_per_token_logps": torch.stack(sampled_logps, dim=1).masked_fill(pad, 0.0),
        "sampler_kept_ids": torch.stack(kept_ids, dim=1).masked_fill(pad[..., None], -1),
        "sampler_kept_logps": torch.stack(kept_logps, dim=1).masked_fill(pad[..., None], -float("inf")),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The results of every configuration, trained by one process and by two."""
    tmp = tmp_path_factory.mktemp("equivalence")
    model = tiny_llama()
    model.save_pretrained(tmp / "model")
    batch_file = tmp / "batch.pt"
    batch = sampled_batch(model, MICRO_BATCHES * WORLD_ROWS)
    torch.save({"model_dir": str(tmp / "model"), "batch": batch}, batch_file)
    worker = REPO / "tests" / "equivalence_worker.py"
    results = {}
    for processes in (1, 2):
        out = tmp / f"{processes}proc.pt"
        done = launch(worker, [str(batch_file), str(out)], processes, vllm=False)
        assert done.returncode == 0, done.stderr[-4000:]
        results[processes] = torch.load(out)
    return results


@pytest.mark.launch
@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_two_processes_make_the_same_update_and_log_the_same_metrics_as_one(runs, name):
    one, two = runs[1][name], runs[2][name]
    assert (one["num_processes"], two["num_processes"], two["distributed_type"]) == (1, 2, "MULTI_CPU")
    for param, before in one["before"].items():
        torch.testing.assert_close(two["before"][param], before, rtol=0, atol=0)
    assert_updates_agree(one["before"], one["update"], two["update"])

    assert len(one["logs"]) == len(two["logs"]) == 2
    assert any(entry["trust_region/masked_fraction"] > 0 for entry in one["logs"]), "the mask should act"
    for entry_one, entry_two in zip(one["logs"], two["logs"], strict=True):
        assert entry_one.keys() == entry_two.keys()
        for key, value in entry_one.items():
            # None: a rate over no token in its window (docs/metrics.md), such as the blocked share of no bad update
            expected = None if value is None else pytest.approx(value, rel=1e-4, abs=1e-6)
            assert entry_two[key] == expected, key
    assert one["masked_token_counts"] == two["masked_token_counts"]


def test_processes_that_would_each_train_alone_are_refused(monkeypatch, tmp_path, tiny_model_dir, prompts, tokenizer):
    """A launcher started 2 processes, but without `use_cpu=True` accelerate finds no backend on a CPU machine."""
    # WORLD_SIZE alone: with TRL's rendezvous variables beside it (RANK, MASTER_ADDR, MASTER_PORT), accelerate would start
    # a process group of 2 and wait for the second process in C++. The colocated engines of the modules marked `vllm`
    # set those in this process, and each such module's fixture puts them back as it found them, here absent
    # (`conftest.rendezvous_variables_restored`)
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = DPPOConfig(
        output_dir=str(tmp_path), report_to="none", bf16=False, per_device_train_batch_size=4, num_generations=4
    )
    assert args.world_size == 1
    with pytest.raises(RuntimeError, match="use_cpu=True"):
        DPPOTrainer(tiny_model_dir, reward_funcs=[], args=args, train_dataset=prompts, processing_class=tokenizer)


def test_the_rendezvous_variables_a_colocated_engine_sets_are_put_back_as_they_were(monkeypatch):
    """What the vLLM modules' fixture does at each module's end: a variable set before gets its value back, one absent
    before is removed, whatever a colocated engine set meanwhile."""
    for name in TORCH_DISTRIBUTED_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    engines_set = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29555")
    with rendezvous_variables_restored():
        for name, value in engines_set.items():
            monkeypatch.setenv(name, value)
    after = {name: os.environ.get(name) for name in TORCH_DISTRIBUTED_ENV}
    assert after == {**dict.fromkeys(TORCH_DISTRIBUTED_ENV), "MASTER_ADDR": "10.0.0.1"}
