"""Top-K under a sharded LM head: real FSDP2 (`fully_shard`) over two CPU processes and gloo.

accelerate 1.15 turns FSDP on only for GPU-class devices (on CPU an FSDP config starts independent processes), so the
trainer under `accelerate launch` with FSDP2 is checked in `benchmarks/gpu_check.sh`; here the trainer's own read of
the LM head (`lm_head_kept_logps`) runs on a model sharded the way FSDP2 shards it.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from accelerate.utils import DistributedType
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import LlamaConfig, LlamaForCausalLM

from trl_dppo.rollout import VOID_ID
from trl_dppo.topk import check_topk_sharding, lm_head_kept_logps


WORLD_SIZE = 2


def _sharded_llama() -> LlamaForCausalLM:
    """A peaked 2-layer Llama, FSDP2-sharded: each decoder layer, then the LM head in a group of its own that
    reshards after forward (as a size-based wrap policy puts a large head), then the root."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model.lm_head, reshard_after_forward=True)
    fully_shard(model)
    return model


def _kept_logps_under_fsdp2(
    rank: int, init_file: str, topks: tuple[int, ...], temperature: float, done_dir: str
) -> None:
    """One process's checks; an assertion that fails here fails the test (mp.spawn re-raises it in the parent), and
    the file it writes once every check passed shows the parent that the checks ran."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE)
    try:
        model = _sharded_llama()
        generator = torch.Generator().manual_seed(rank)  # each process has its own data, as in data parallelism
        input_ids = torch.randint(512, (3, 9), generator=generator)
        hidden = []  # what the trainer's forward hook sees: the backbone's output
        model.model.register_forward_hook(lambda m, a, out: hidden.append(out.last_hidden_state))
        with torch.no_grad():
            full = torch.log_softmax(model(input_ids).logits.float() / temperature, dim=-1)  # the reference
        head = model.lm_head
        assert isinstance(head.weight, DTensor) and head.weight.to_local().size(0) == 512 // WORLD_SIZE

        sampled = torch.randint(512, (3, 9), generator=generator)
        sampled_logps = full.gather(-1, sampled[..., None]).squeeze(-1)
        for topk in topks:
            kept = full.topk(topk, dim=-1).indices
            extra = torch.where((kept == sampled[..., None]).any(-1), VOID_ID, sampled)
            kept = torch.cat([kept, extra[..., None]], dim=-1)

            got = lm_head_kept_logps(head, hidden[0], sampled, sampled_logps, kept, temperature)

            want = full.gather(-1, kept.clamp_min(0)).masked_fill(kept < 0, -math.inf)
            # log_softmax_atol(512, 10) = 4e-5 for the reference, plus the logits' dot products over 32 in another
            # order (FSDP's gathered rows): 1e-4 bounds both, ten times below a wrong kept set's error
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
            assert isinstance(head.weight, DTensor)  # the head is left sharded
        Path(done_dir, f"rank{rank}").write_text(" ".join(map(str, topks)))
        # Every process is past its last collective before either tears the group down: a gloo process whose peer
        # closed the group mid-transfer aborts ("terminate called without an active exception")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.launch
def test_kept_logps_read_from_an_fsdp2_sharded_head_equal_the_full_log_softmax(tmp_path, monkeypatch):
    """Each process holds half the vocabulary rows of the LM head (a DTensor); its kept-set log-probabilities, read
    outside the head's forward pass, still equal log_softmax of the full logits at the kept ids (K = 1 and 8)."""
    # The spawned processes import this module by name; the repository goes last on their path, so that a run
    # against the installed wheel (--import-mode=importlib) still imports trl_dppo from the wheel
    monkeypatch.setattr(sys, "path", [*sys.path, str(Path(__file__).resolve().parents[1])])
    args = (str(tmp_path / "init"), (1, 8), 0.7, str(tmp_path))
    mp.spawn(_kept_logps_under_fsdp2, args=args, nprocs=WORLD_SIZE, join=True)
    assert [(tmp_path / f"rank{rank}").read_text() for rank in range(WORLD_SIZE)] == ["1 8"] * WORLD_SIZE


def test_topk_under_fsdp1_is_refused_and_fsdp2_accepted():
    with pytest.raises(ValueError, match="fsdp_version: 2"):
        check_topk_sharding(SimpleNamespace(distributed_type=DistributedType.FSDP, is_fsdp2=False))
    assert check_topk_sharding(SimpleNamespace(distributed_type=DistributedType.FSDP, is_fsdp2=True)) is None
    check_topk_sharding(SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, is_fsdp2=False))
    check_topk_sharding(SimpleNamespace(distributed_type=DistributedType.MULTI_CPU, is_fsdp2=False))
