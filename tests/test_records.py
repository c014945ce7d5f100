"""The generation batch's record store, and the row tags its tokens carry through GRPOTrainer's float lists."""

from __future__ import annotations

import math
import pickle
import struct
import subprocess
import sys

import pytest
import torch

from trl_dppo.records import (
    VOID_ID,
    MissingRecordsError,
    SamplerRecords,
    complete_kept_sets_,
    tag_logps,
    tagged_lists,
    tagged_rows,
)


# float32 values that must survive tagging bit for bit, as TRL turns the floats into `sampling_per_token_logps`
EDGE_VALUES = torch.tensor(
    [0.0, -0.0, -1e-45, -1.2e-38, -3.4e38, -1.0, -0.1234567, -17.5, float("nan"), float("-inf")], dtype=torch.float32
)


def trl_float32(values: list[float]) -> torch.Tensor:
    """What GRPOTrainer does with a completion's floats: `torch.tensor` of the list (float32)."""
    return torch.tensor([float("nan") if x is None else x for x in values])


def record(store: SamplerRecords, sampled: torch.Tensor, lengths: list[int], *kept) -> list[list[float]]:
    """One backend call: its records into the store, and its sampled log-probabilities as handed to TRL, tagged."""
    return list(tagged_lists(sampled, lengths, store.add(sampled.shape, *kept)))


def test_tags_vanish_in_the_float32_tensor_trl_builds_bit_for_bit():
    tagged = tag_logps(EDGE_VALUES, first_row=(1 << 27) - 20).tolist()
    assert trl_float32(tagged).view(torch.int32).tolist() == EDGE_VALUES.view(torch.int32).tolist()
    # ... while the float64 values carry their rows (all but -inf, which cannot carry one)
    rows = tagged_rows([tagged], len(tagged))[0].tolist()
    assert rows[:-1] == list(range((1 << 27) - 20, (1 << 27) - 20 + len(tagged) - 1)) and rows[-1] == -1


def test_tags_survive_pickling_to_another_process():
    """Processes exchange the float lists by pickling (accelerate's gather_object); the bits stay."""
    tagged = tag_logps(EDGE_VALUES, first_row=5).tolist()
    script = (
        "import pickle, struct, sys; v = pickle.load(sys.stdin.buffer); print([struct.pack('<d', x).hex() for x in v])"
    )
    out = subprocess.run([sys.executable, "-c", script], input=pickle.dumps(tagged), capture_output=True, check=True)
    assert out.stdout.decode().strip() == str([struct.pack("<d", x).hex() for x in tagged])


def test_kept_sets_take_the_sampled_token_only_when_outside_the_top_k():
    ids = torch.tensor([[4, 9, 0], [4, 9, 0]], dtype=torch.int32)
    logps = torch.tensor([[-0.5, -2.0, 0.0], [-0.5, -2.0, 0.0]])
    complete_kept_sets_(ids, logps, torch.tensor([9, 5], dtype=torch.int32), torch.tensor([-2.0, -6.5]))
    assert ids.tolist() == [[4, 9, VOID_ID], [4, 9, 5]]
    assert logps.tolist() == [[-0.5, -2.0, -math.inf], [-0.5, -2.0, -6.5]]


def test_rows_follow_tokens_through_tool_stitching_and_truncation():
    """TRL stitches `logprobs[i] += [0.0] * tool_len + post_tool` and truncates with slices."""
    store = SamplerRecords(topk=2)
    first = record(  # a generation call of two sequences, padded to the longer one
        store,
        torch.tensor([[-0.1, -0.2], [-0.3, math.nan]]),
        [2, 1],
        torch.tensor([[[1, 2, VOID_ID], [3, 4, VOID_ID]], [[5, 6, VOID_ID], [VOID_ID] * 3]]),
        torch.tensor([[[-0.1, -2.0, -math.inf], [-0.5, -0.6, -math.inf]], [[-1.0, -1.1, -math.inf], [-math.inf] * 3]]),
    )
    [post_tool] = record(
        store, torch.tensor([[-0.7]]), [1], torch.tensor([[[7, 8, 42]]]), torch.tensor([[[-0.9, -0.9, -0.7]]])
    )
    rows = [first[0] + [0.0, 0.0] + post_tool, first[1]]
    store.rollout_logprobs = rows
    completion_ids = torch.tensor([[1, 3, 100, 101, 42, 0], [6, 0, 0, 0, 0, 0]])
    sampling = torch.nn.utils.rnn.pad_sequence([trl_float32(r) for r in rows], batch_first=True)
    sampling = torch.nn.functional.pad(sampling, (0, 1))
    loss_mask = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 0, 0, 0, 0, 0]])  # the tool result leaves the loss
    batch = store.batch_tensors(completion_ids, sampling, loss_mask)
    ids, logps = batch["sampler_kept_ids"], batch["sampler_kept_logps"]
    assert ids.shape == (2, 6, 3) and ids.dtype == torch.int32 and logps.dtype == torch.float32
    empty = [VOID_ID] * 3
    assert ids[0].tolist() == [[1, 2, VOID_ID], [3, 4, VOID_ID], empty, empty, [7, 8, 42], empty]
    assert logps[0, 4].tolist() == [-0.8999999761581421, -0.8999999761581421, -0.699999988079071]
    assert logps[0, 2].tolist() == [-math.inf] * 3  # a tool-result token has no kept set
    assert ids[1, 0].tolist() == [5, 6, VOID_ID] and (ids[1, 1:] == VOID_ID).all()
    assert "sampler_base_logps" not in batch


def test_one_generation_call_without_tool_calls_is_its_own_batch_no_copy():
    """The usual case: the batch tensors are the store's memory, so top-K costs (K + 1) x 8 bytes per token once."""
    store = SamplerRecords(topk=1)
    kept_ids = torch.tensor([[[3, VOID_ID], [4, 8]], [[5, VOID_ID], [1, 1]]], dtype=torch.int32)
    kept_logps = torch.tensor([[[-0.1, -math.inf], [-0.2, -3.0]], [[-0.3, -math.inf], [-9.0, -9.0]]])
    # the second completion ended early
    store.rollout_logprobs = record(store, torch.tensor([[-0.1, -3.0], [-0.3, -9.0]]), [2, 1], kept_ids, kept_logps)
    loss_mask = torch.tensor([[1, 1], [1, 0]])
    batch = store.batch_tensors(torch.tensor([[3, 8], [5, 0]]), torch.tensor([[-0.1, -3.0], [-0.3, 0.0]]), loss_mask)
    assert batch["sampler_kept_ids"].data_ptr() == kept_ids.data_ptr()
    assert batch["sampler_kept_logps"].data_ptr() == kept_logps.data_ptr()
    assert batch["sampler_kept_ids"].tolist() == [[[3, VOID_ID], [4, 8]], [[5, VOID_ID], [VOID_ID, VOID_ID]]]
    assert batch["sampler_kept_logps"][1, 1].tolist() == [-math.inf, -math.inf]  # padding has no kept set


def test_base_logps_are_kept_only_when_recorded():
    store = SamplerRecords(topk=1)
    store.rollout_logprobs = record(
        store,
        torch.tensor([[-0.5]]),
        [1],
        torch.tensor([[[3, 7]]]),
        torch.tensor([[[-0.2, -0.9]]]),
        torch.tensor([[-0.9]]),
    )
    batch = store.batch_tensors(torch.tensor([[7]]), torch.tensor([[-0.5]]), torch.ones(1, 1))
    assert batch["sampler_base_logps"].tolist() == [[-0.8999999761581421]]
    assert batch["sampler_kept_ids"].tolist() == [[[3, 7]]]


def test_binary_records_without_base_need_nothing_beyond_the_float():
    store = SamplerRecords(topk=0)
    assert not store.needed
    assert store.batch_tensors(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3), torch.ones(2, 3)) == {}


def test_a_call_without_base_records_takes_the_sampled_log_prob_as_base():
    """Two calls (a tool call between them), only the first with a warper: the second's mu_base is its mu."""
    store = SamplerRecords(topk=0)
    [first] = record(store, torch.tensor([[-0.5, -0.25]]), [2], None, None, torch.tensor([[-0.75, -1.5]]))
    [second] = record(store, torch.tensor([[-2.0]]), [1])
    store.rollout_logprobs = [first + [0.0] + second]
    sampling = torch.tensor([[-0.5, -0.25, 0.0, -2.0]])
    batch = store.batch_tensors(torch.tensor([[1, 2, 3, 4]]), sampling, torch.tensor([[1, 1, 0, 1]]))
    assert batch["sampler_base_logps"].tolist() == [[-0.75, -1.5, 0.0, -2.0]]


def test_runs_of_a_few_tokens_give_the_rows_and_views_of_one_pass(monkeypatch):
    """Tagging and the layout check go a run of sequences at a time (bounded memory); runs change nothing."""
    monkeypatch.setattr("trl_dppo.records.RUN_TOKENS", 4)
    store = SamplerRecords(topk=1)
    sampled = -torch.rand(5, 3)
    kept_ids = torch.arange(30, dtype=torch.int32).view(5, 3, 2)
    lengths = [3, 1, 2, 3, 0]
    store.rollout_logprobs = record(store, sampled, lengths, kept_ids, torch.zeros(5, 3, 2))
    assert [len(row) for row in store.rollout_logprobs] == lengths
    assert tagged_rows(store.rollout_logprobs, 3).tolist() == [
        [0, 1, 2], [3, -1, -1], [6, 7, -1], [9, 10, 11], [-1, -1, -1]
    ]  # fmt: skip
    loss_mask = torch.arange(3) < torch.tensor(lengths)[:, None]
    batch = store.batch_tensors(torch.zeros(5, 3, dtype=torch.long), sampled, loss_mask)
    assert batch["sampler_kept_ids"].data_ptr() == kept_ids.data_ptr()
    assert batch["sampler_kept_ids"][1].tolist() == [[6, 7], [VOID_ID, VOID_ID], [VOID_ID, VOID_ID]]
    assert batch["sampler_kept_ids"][3].tolist() == [[18, 19], [20, 21], [22, 23]]
    assert (batch["sampler_kept_ids"][4] == VOID_ID).all()


@pytest.mark.parametrize("topk, base", [(2, False), (0, True)], ids=["top-k", "mu_base"])
def test_a_loss_token_whose_row_was_lost_stops_the_batch(topk, base):
    """Rounded to float32 before stitching, the floats carry no rows: the top-K divergence of an empty kept set would
    be 0 and mu_base would silently become mu, so the batch stops instead."""
    store = SamplerRecords(topk=topk)
    kept = (torch.tensor([[[1, 2, VOID_ID]]]), torch.tensor([[[-0.1, -2.5, -math.inf]]])) if topk else (None, None)
    tagged = record(store, torch.tensor([[-0.1]]), [1], *kept, torch.tensor([[-0.3]]) if base else None)
    store.rollout_logprobs = [trl_float32(row).tolist() for row in tagged]  # the tags rounded away
    with pytest.raises(MissingRecordsError, match="1 of the batch's 1 loss tokens carry no row"):
        store.batch_tensors(torch.tensor([[1]]), torch.tensor([[-0.1]]), torch.ones(1, 1))


def test_tokens_out_of_the_loss_or_without_a_sampler_probability_need_no_row():
    """Tool results (0.0, out of the loss through tool_mask), padding and a -inf log-prob (which leaves the loss)."""
    store = SamplerRecords(topk=1)
    [tagged] = record(store, torch.tensor([[-0.5]]), [1], torch.tensor([[[4, 9]]]), torch.tensor([[[-0.2, -0.5]]]))
    store.rollout_logprobs = [tagged + [0.0, -math.inf]]
    sampling = torch.tensor([[-0.5, 0.0, -math.inf, 0.0]])
    batch = store.batch_tensors(torch.tensor([[9, 7, 7, 0]]), sampling, torch.tensor([[1, 0, 1, 0]]))
    assert batch["sampler_kept_ids"][0, 0].tolist() == [4, 9] and (batch["sampler_kept_ids"][0, 1:] == VOID_ID).all()
