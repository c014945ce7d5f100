"""What recording mu costs, against what GRPOTrainer spends on the same log-probabilities, from 10k to 1M tokens.

Part 1, the record path: synthetic backend output, no model. vLLM-shaped: the nested lists `VLLMGeneration.generate`
returns (per sequence, per token, K or K + 1 log-probs and ids sorted by rank, or one with `logprobs=0`). vLLM server:
the JSON body of a `vllm serve` response to TRL's client (OpenAI completions, tokens as ids: per token a dict of the
sampled token and the top K). transformers-shaped: the recorder's buffers after `generate()`. vLLM colocate: the
`RequestOutput`s of the engine's `generate` (per-token dicts, as TRL reads them; flat, as DPPO asks for them). For
each size and mode (binary; top-K, K = 20), in one process:

- TRL: GRPOTrainer's own handling. vLLM: `GRPOTrainer._generate_single_turn` itself, called on a stub trainer with a
  stub backend (it keeps entry 0 of each token), then the padding into `sampling_per_token_logps` (the two statements
  of `_generate_and_score_completions` that do it, calling TRL's `pad`; that method cannot run alone). transformers:
  TRL records no log-probabilities there, so its reference is that padding of the same per-completion floats. vLLM
  colocate: what TRL's `VLLMGeneration.generate` does with the engine's output (`extract_logprobs`), then the same;
  for the same top-K output, and for TRL's default `logprobs=0` output of the same tokens. vLLM server: TRL's
  `VLLMClient.generate` on the body (the HTTP request stubbed, the JSON decoded as `requests` does), then the same;
  for the same top-K response and for the `logprobs=0` response TRL asks for by default.
- DPPO: the whole record path, from the backend's output to the batch tensors: the wrapped backend
  (`record_vllm_logprobs` on TRL's lists, or `record_vllm_flat_logprobs` on the engine's output) or
  `SamplerLogprobRecorder.finish`, the same GRPOTrainer code, then `SamplerRecords.batch_tensors`.

Time: best of `--repeats` runs, alternating TRL and DPPO. Memory, per token: the resident memory's high-water mark
during the path above where it started (Linux's VmHWM, reset before the path: Python, numpy and torch alike), plus the
records that exist before it (the recorder's buffers); and the bytes the batch tensors keep.

Routing rows (router replay, R3, on transformers generation; binary): DPPO's path is the binary transformers path
above plus what the routing recorder's forward hooks keep during `generate()` (the hook called as a router returns its
top-k indices, int64: one `(B * P, k)` prefill call per layer, then one `(B, k)` call per layer per decoding step),
`RoutingRecorder.sequence_routes`, `SamplerRecords.add_routes` and `batch_routes`; TRL's reference is the binary
transformers one (TRL keeps no routes). Shapes: the tests' tiny MoE (2 layers, k = 2) and Qwen3-30B-A3B (48, k = 8);
prompts of 16 to 64 tokens, left-padded to 64.

Part 2, the recorder in real generation: `generate()` on SmolLM2-135M (the offline default model) at batch 64 x 256
new tokens, with no recorder, the binary recorder and the top-K recorder, interleaved, `--model-repeats` times each.

    .venv/bin/python benchmarks/records_scaling.py --out benchmarks/results/records_scaling
    .venv/bin/python benchmarks/records_scaling.py --backends 'vllm colocate' --model-repeats 0  # rerun some rows
    .venv/bin/python benchmarks/records_scaling.py --backends 'transformers R3' --model-repeats 0  # the routing rows
    .venv/bin/python benchmarks/records_scaling.py --backends --model-repeats 5  # rerun the generation part alone
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import gc
import json
import pickle
import random
import re
import shlex
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trl import GRPOTrainer  # noqa: E402
from trl.generation.vllm_client import VLLMClient  # noqa: E402
from trl.generation.vllm_generation import extract_logprobs  # noqa: E402
from trl.trainer.utils import pad  # noqa: E402

from trl_dppo.moe import RoutingRecorder  # noqa: E402
from trl_dppo.records import SamplerRecords  # noqa: E402
from trl_dppo.rollout import (  # noqa: E402
    SamplerLogprobRecorder,
    record_vllm_flat_logprobs,
    record_vllm_logprobs,
)


VOCAB = 49152
SEQ_LEN = 1000  # tokens per completion


# ------------------------------------------------------------------------------------------- synthetic outputs


def vllm_output(tokens: int, topk: int, seed: int = 0):
    """`VLLMGeneration.generate`'s four lists for `tokens` sampled tokens."""
    rng = random.Random(seed)
    completion_ids, logprobs, token_ids = [], [], []
    for _ in range(tokens // SEQ_LEN):
        seq_ids, seq_lps, seq_tids = [], [], []
        for _ in range(SEQ_LEN):
            token = rng.randrange(VOCAB)
            if not topk:
                seq_lps.append([float(torch.tensor(-rng.random() * 3).float())])
                seq_tids.append([token])
            else:
                top = rng.sample(range(VOCAB), topk)
                lps = sorted((-rng.random() * 8 for _ in range(topk + 1)), reverse=True)
                lps = [float(x) for x in torch.tensor(lps, dtype=torch.float32).tolist()]
                if rng.random() < 0.8:  # the sampled token is usually among the top K
                    token = top[rng.randrange(topk)]
                    seq_tids.append(top)
                    seq_lps.append(lps[:topk])
                else:
                    seq_tids.append(top + [token])
                    seq_lps.append(lps)
            seq_ids.append(token)
        completion_ids.append(seq_ids)
        logprobs.append(seq_lps)
        token_ids.append(seq_tids)
    return [[1, 2, 3]] * len(completion_ids), completion_ids, logprobs, token_ids


def engine_outputs(lists, topk: int, flat: bool):
    """The `RequestOutput`s a colocated `LLM.generate` returns for `vllm_output`'s tokens: vLLM's default per-token
    dicts of `Logprob` (what TRL reads), or, `flat`, its `FlatLogprobs` (the sampled entry, then the top K)."""
    from vllm.logprobs import FlatLogprobs, Logprob

    _, completion_ids, logprobs, token_ids = lists
    requests = []
    for tokens, seq_lps, seq_tids in zip(completion_ids, logprobs, token_ids, strict=True):
        entries = FlatLogprobs() if flat else []
        for token, lps, tids in zip(tokens, seq_lps, seq_tids, strict=True):
            rank = tids.index(token) + 1
            if flat:
                top = tids[:topk] if topk else []
                ranks = iter([rank, *range(1, len(top) + 1)])
                entries.append_fast([token, *top], [lps[rank - 1], *lps[: len(top)]], ranks, [None] * (len(top) + 1))
            elif not topk:  # TRL's default request, logprobs=0: the sampled token alone
                entries.append({token: Logprob(lps[rank - 1], rank=rank)})
            else:  # vLLM puts the sampled token first; a dict keeps one entry per token
                ranked = [(rank - 1, (token, lps[rank - 1])), *enumerate(zip(tids, lps, strict=True))]
                entries.append({tid: Logprob(lp, rank=i + 1) for i, (tid, lp) in ranked})
        output = SimpleNamespace(token_ids=tokens, logprobs=entries)
        requests.append(SimpleNamespace(prompt_token_ids=[1, 2, 3], outputs=[output]))
    return requests


def server_body(lists, topk: int) -> bytes:
    """The JSON body a vLLM server (`vllm serve`, OpenAI completions with tokens as ids, as TRL's client asks) returns
    for `vllm_output`'s tokens asked for `topk` log-probs: per token the sampled token and its log-prob, and a dict of
    the sampled token then the top K (one entry per token)."""
    _, completion_ids, logprobs, token_ids = lists
    choices = []
    for index, (tokens, seq_lps, seq_tids) in enumerate(zip(completion_ids, logprobs, token_ids, strict=True)):
        sampled = [lps[tids.index(token)] for token, lps, tids in zip(tokens, seq_lps, seq_tids, strict=True)]
        tops = [
            {f"token_id:{t}": lp for t, lp in [(token, logp), *zip(tids[:topk], lps[:topk], strict=True)]}
            for token, logp, lps, tids in zip(tokens, sampled, seq_lps, seq_tids, strict=True)
        ]
        entries = {
            "text_offset": list(range(len(tokens))),
            "token_logprobs": sampled,
            "tokens": [f"token_id:{t}" for t in tokens],
            "top_logprobs": tops,
        }
        choice = {"index": index, "text": "", "logprobs": entries, "finish_reason": "length"}
        choices.append({**choice, "prompt_token_ids": [1, 2, 3], "token_ids": tokens})
    return json.dumps({"id": "cmpl-0", "object": "text_completion", "model": "m", "choices": choices}).encode()


def recorder_buffers(tokens: int, topk: int, seed: int = 0):
    """The buffers a `SamplerLogprobRecorder` holds after `generate()` (`(batch, steps, ...)`: the top K in the kept
    sets' first K slots, the last one is filled by `finish`), and the completions."""
    gen = torch.Generator().manual_seed(seed)
    batch = tokens // SEQ_LEN
    completion = torch.randint(VOCAB, (batch, SEQ_LEN), generator=gen)
    buffers = {"sampled": -torch.rand(batch, SEQ_LEN, generator=gen) * 3}
    if topk:
        top_ids = torch.randint(VOCAB, (batch, SEQ_LEN, topk), generator=gen, dtype=torch.int32)
        in_top = torch.rand(batch, SEQ_LEN, generator=gen) < 0.8  # the sampled token is usually among the top K
        top_ids[..., 0] = torch.where(in_top, completion.int(), top_ids[..., 0])
        top_logps = -torch.rand(batch, SEQ_LEN, topk, generator=gen).sort(-1).values * 8
        buffers["kept_ids"] = torch.cat([top_ids, torch.zeros(batch, SEQ_LEN, 1, dtype=torch.int32)], -1)
        buffers["kept_logps"] = torch.cat([top_logps, torch.zeros(batch, SEQ_LEN, 1)], -1)
    return buffers, completion.tolist()


# ------------------------------------------------------------------------------------------------- the paths


def stub_trainer(generate):
    """Just what `GRPOTrainer._generate_single_turn` reads on the vLLM path (weights already synced)."""
    return SimpleNamespace(
        use_vllm=True,
        state=SimpleNamespace(global_step=0),
        _last_loaded_step=0,
        vllm_generation=SimpleNamespace(generate=generate),
        args=SimpleNamespace(report_to=[]),
        accelerator=SimpleNamespace(device=torch.device("cpu"), is_main_process=True),
    )


def trl_padding(logprobs: list[list[float]]) -> torch.Tensor:
    """`_generate_and_score_completions`' padding of the rollout's log-probabilities (TRL 1.16)."""
    tensors = [torch.tensor([float("nan") if x is None else x for x in logps]) for logps in logprobs]
    return pad(tensors, padding_value=0.0, padding_side="right")


def completion_tensor(completion_ids: list[list[int]]) -> torch.Tensor:
    return pad([torch.tensor(ids) for ids in completion_ids], padding_value=0, padding_side="right")


def trl_vllm(data, topk):
    output, completions = data
    stub = stub_trainer(lambda **kwargs: output)
    _, logprobs = GRPOTrainer._generate_single_turn(stub, output[0], None, {}, 1)
    return [trl_padding(logprobs)]


def fresh_vllm_lists(data, topk):
    """A real backend makes its per-token lists and floats afresh for each call; DPPO's wrapper writes entry 0 of them
    (a float it replaces is freed, so copies by pickling: a list's copy would share the floats)."""
    output, completions = data
    return ((output[0], output[1], pickle.loads(pickle.dumps(output[2])), output[3]), completions)


def to_batch(records, logprobs, completions):
    """DPPO's side of the path after the backend: TRL's padding, then the batch tensors from the store."""
    sampling = trl_padding(logprobs)
    if records.needed:
        records.rollout_logprobs = logprobs
    loss_mask = torch.arange(sampling.size(1)) < torch.tensor([len(logps) for logps in logprobs])[:, None]
    batch = records.batch_tensors(completions, sampling, loss_mask)
    return [sampling, *batch.values()]


def dppo_vllm(data, topk):
    output, completions = data
    records = SamplerRecords(topk=topk)
    stub = stub_trainer(record_vllm_logprobs(lambda **kwargs: output, topk, lambda: records))
    completion_ids, logprobs = GRPOTrainer._generate_single_turn(stub, output[0], None, {}, 1)
    return to_batch(records, logprobs, completions)


def from_server(body: bytes, topk: int):
    """`VLLMClient.generate` on a server's response body (TRL 1.16): the HTTP request stubbed, the JSON decoding kept
    (`requests`' `response.json()`), then what `VLLMGeneration.generate` returns on one process."""
    choices = json.loads(body)["choices"]
    client = SimpleNamespace(base_url="http://stub", model="m", _post=lambda url, json: {"choices": choices})
    output = VLLMClient.generate(client, [[1, 2, 3]] * len(choices), logprobs=topk)
    return output["prompt_ids"], output["completion_ids"], output["logprobs"], output["logprob_token_ids"]


def trl_server(data, topk):
    (trl_body, trl_topk, _), completions = data
    stub = stub_trainer(lambda **kwargs: from_server(trl_body, trl_topk))
    _, logprobs = GRPOTrainer._generate_single_turn(stub, [[1, 2, 3]] * completions.size(0), None, {}, 1)
    return [trl_padding(logprobs)]


def dppo_server(data, topk):
    (_, _, body), completions = data
    records = SamplerRecords(topk=topk)
    stub = stub_trainer(record_vllm_logprobs(lambda **kwargs: from_server(body, topk), topk, lambda: records))
    completion_ids, logprobs = GRPOTrainer._generate_single_turn(stub, [[1, 2, 3]] * completions.size(0), None, {}, 1)
    return to_batch(records, logprobs, completions)


def from_engine(request_outputs):
    """What TRL's colocate `VLLMGeneration.generate` does with `LLM.generate`'s output (TRL 1.16, tp = 1)."""
    prompt_ids = [request.prompt_token_ids for request in request_outputs]
    completion_ids = [output.token_ids for request in request_outputs for output in request.outputs]
    logprobs, token_ids = extract_logprobs(request_outputs)
    return prompt_ids, completion_ids, logprobs, token_ids


def trl_colocate(data, topk):
    outputs, completions = data
    stub = stub_trainer(lambda **kwargs: from_engine(outputs))
    _, logprobs = GRPOTrainer._generate_single_turn(stub, [[1, 2, 3]] * len(outputs), None, {}, 1)
    return [trl_padding(logprobs)]


def fresh_flat_outputs(data, topk):
    """vLLM makes its flat lists afresh for each call; DPPO's wrapper cuts them to the sampled entry (and the floats
    it drops are freed)."""
    (trl_outputs, flat_outputs), completions = data
    copies = []
    for request in flat_outputs:
        output = request.outputs[0]
        entries = copy.copy(output.logprobs)
        for name in ("start_indices", "end_indices", "token_ids", "logprobs", "ranks", "decoded_tokens"):
            setattr(entries, name, pickle.loads(pickle.dumps(getattr(entries, name))))  # new floats too
        output = SimpleNamespace(token_ids=output.token_ids, logprobs=entries)
        copies.append(SimpleNamespace(prompt_token_ids=request.prompt_token_ids, outputs=[output]))
    return (trl_outputs, copies), completions


def trl_colocate_of(data, topk):
    (trl_outputs, _), completions = data
    return trl_colocate((trl_outputs, completions), topk)


def dppo_colocate(data, topk):
    (_, flat_outputs), completions = data
    records = SamplerRecords(topk=topk)
    engine = record_vllm_flat_logprobs(lambda: flat_outputs, topk, lambda: records)
    stub = stub_trainer(lambda **kwargs: from_engine(engine()))
    completion_ids, logprobs = GRPOTrainer._generate_single_turn(stub, [[1, 2, 3]] * len(flat_outputs), None, {}, 1)
    return to_batch(records, logprobs, completions)


def trl_transformers(data, topk):
    (buffers, completion_ids), completions = data
    return [trl_padding(buffers["sampled"].tolist())]


def dppo_transformers(data, topk):
    (buffers, completion_ids), completions = data
    recorder = SamplerLogprobRecorder(topk)
    recorder._buffers, recorder.steps = dict(buffers), buffers["sampled"].size(1)
    records = SamplerRecords(topk=topk)
    logprobs = recorder.finish(completion_ids, records)
    return to_batch(records, logprobs, completions)


# MoE shapes of the routing rows: MoE layers, experts, top-k
MOE_SHAPES = {"tiny MoE (2 layers, k = 2)": (2, 4, 2), "Qwen3-30B-A3B (48 layers, k = 8)": (48, 128, 8)}
PROMPT_WIDTH = 64  # the routing rows' prompts: 16 to 64 tokens, left-padded to the longest
ROUTER_OUTPUTS = 16  # distinct decoding-step router outputs per layer, reused in turn (their values cost nothing)


def routing_data(tokens: int, topk: int, shape: str):
    """The binary recorder's buffers and completions, and what the routers return during `generate()` for them: a
    prefill over the left-padded prompts `(B * P, k)` int64 per layer, then `(B, k)` per layer per decoding step."""
    (buffers, completion_ids), _ = buffers_data(tokens, topk)
    layers, experts, k = MOE_SHAPES[shape]
    gen = torch.Generator().manual_seed(1)
    batch = len(completion_ids)
    lengths = torch.randint(16, PROMPT_WIDTH + 1, (batch,), generator=gen)
    lengths[0] = PROMPT_WIDTH
    prompt_ids = [torch.randint(VOCAB, (int(n),), generator=gen).tolist() for n in lengths]
    prompts = pad([torch.tensor(ids) for ids in prompt_ids], padding_value=0, padding_side="left")
    prompt_mask = torch.arange(PROMPT_WIDTH) >= PROMPT_WIDTH - lengths[:, None]
    routers = SimpleNamespace(
        layers=layers,
        prefill=[torch.randint(experts, (batch * PROMPT_WIDTH, k), generator=gen) for _ in range(layers)],
        steps=[torch.randint(experts, (batch, k), generator=gen) for _ in range(ROUTER_OUTPUTS)],
        prompt_ids=prompt_ids,
        prompts=prompts,
        prompt_mask=prompt_mask.long(),
    )
    return (buffers, completion_ids, routers), completion_ids


def trl_transformers_routing(data, topk):
    (buffers, completion_ids, _), completions = data
    return trl_transformers(((buffers, completion_ids), completions), topk)


def dppo_transformers_routing(data, topk):
    """The binary transformers path with router replay: the routing recorder's hook calls as `generate()` makes them
    (`_generate_single_turn`), its routes cut per completion into the store, then the batch's routes."""
    (buffers, completion_ids, routers), completions = data
    routing = RoutingRecorder([None] * routers.layers)  # the hooks' own work; registering them is not timed
    for layer in range(routers.layers):
        routing._read(layer, None, None, (None, None, routers.prefill[layer]))
    for step in range(SEQ_LEN - 1):  # the last sampled token is never forwarded
        for layer in range(routers.layers):
            routing._read(layer, None, None, (None, None, routers.steps[(step + layer) % ROUTER_OUTPUTS]))
    recorder = SamplerLogprobRecorder(topk)
    recorder._buffers, recorder.steps = dict(buffers), buffers["sampled"].size(1)
    records = SamplerRecords(topk=topk)
    records.add_routes(*routing.sequence_routes(routers.prompt_ids, completion_ids))
    logprobs = recorder.finish(completion_ids, records)
    batch = to_batch(records, logprobs, completions)
    return [*batch, records.batch_routes(routers.prompts, routers.prompt_mask, completions)]


def fresh_routing_buffers(data, topk):
    (buffers, completion_ids, routers), completions = data
    ((buffers, completion_ids), _) = fresh_buffers(((buffers, completion_ids), completions), topk)
    return (buffers, completion_ids, routers), completions


LIBC = ctypes.CDLL("libc.so.6")


def resident_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))


def measure(path, prepare, data, topk, held: int):
    """Seconds, peak bytes and batch bytes of one run of `path`.

    Peak: the process's resident memory at its highest during the path (Linux's high-water mark, reset just before)
    above what it was before, plus `held`, the bytes of records that exist before the path (the recorder's buffers).
    """
    fresh = prepare(data, topk)
    gc.collect()
    start = time.perf_counter()
    path(fresh, topk)
    seconds = time.perf_counter() - start
    fresh = prepare(data, topk)  # from the untouched data: DPPO's paths write into vLLM's lists
    gc.collect()
    LIBC.malloc_trim(0)  # free heap memory goes back to the system, so the path's allocations show as new pages
    before = resident_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size
    kept = path(fresh, topk)
    peak = (resident_kib("VmHWM") - before) * 1024 + held
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in kept}
    return seconds, peak, sum(storages.values())


def same(data, topk):
    return data


def fresh_buffers(data, topk):
    """A recorder fills its buffers afresh in each `generate()`; `finish` completes the kept sets in place."""
    (buffers, completion_ids), completions = data
    return ({key: value.clone() for key, value in buffers.items()}, completion_ids), completions


def lists_data(tokens: int, topk: int):
    output = vllm_output(tokens, topk)
    return output, output[1]


def colocate_data(tokens: int, topk: int, trl_topk: int):
    """vLLM's output for the same tokens: as TRL would read it (asking for `trl_topk`), and flat for DPPO."""
    lists = vllm_output(tokens, topk)
    return (engine_outputs(lists, trl_topk, flat=False), engine_outputs(lists, topk, flat=True)), lists[1]


def server_data(tokens: int, topk: int, trl_topk: int):
    """A server's response for the same tokens: asked for `trl_topk` log-probs (TRL), and for K (DPPO)."""
    lists = vllm_output(tokens, topk)
    dppo_body = server_body(lists, topk)
    trl_body = dppo_body if trl_topk == topk else server_body(lists, trl_topk)
    return (trl_body, trl_topk, dppo_body), lists[1]


def buffers_data(tokens: int, topk: int):
    buffers, completion_ids = recorder_buffers(tokens, topk)
    return (buffers, completion_ids), completion_ids


# backend, mode, K, (tokens, K) -> (data, completion ids), TRL's path, DPPO's path, DPPO's fresh copy of the data
CASES = [
    ("vllm", "binary", 0, lists_data, trl_vllm, dppo_vllm, fresh_vllm_lists),
    ("vllm", "top-20", 20, lists_data, trl_vllm, dppo_vllm, fresh_vllm_lists),
    ("vllm server", "top-20", 20, lambda n, k: server_data(n, k, k), trl_server, dppo_server, same),
    ("vllm server", "top-20 vs TRL logprobs=0", 20, lambda n, k: server_data(n, k, 0), trl_server, dppo_server, same),
    ("vllm colocate", "top-20", 20, lambda n, k: colocate_data(n, k, k), trl_colocate_of, dppo_colocate,
     fresh_flat_outputs),
    ("vllm colocate", "top-20 vs TRL logprobs=0", 20, lambda n, k: colocate_data(n, k, 0), trl_colocate_of,
     dppo_colocate, fresh_flat_outputs),
    ("transformers", "binary", 0, buffers_data, trl_transformers, dppo_transformers, fresh_buffers),
    ("transformers", "top-20", 20, buffers_data, trl_transformers, dppo_transformers, fresh_buffers),
    *(("transformers R3", f"binary + routes, {shape}", 0, lambda n, k, shape=shape: routing_data(n, k, shape),
       trl_transformers_routing, dppo_transformers_routing, fresh_routing_buffers) for shape in MOE_SHAPES),
]  # fmt: skip


def scaling(sizes: list[int], repeats: int, backends: list[str]) -> list[dict]:
    rows = []
    for backend, mode, topk, make, trl_path, dppo_path, fresh in CASES:
        if backend not in backends:
            continue
        for tokens in sizes:
            raw, completion_ids = make(tokens, topk)
            data = (raw, completion_tensor(completion_ids))
            # transformers: the recorder's buffers exist before the path; TRL would hold the sampled floats only
            buffers = raw[0] if backend.startswith("transformers") else {}
            held = {
                "trl": sum(t.nbytes for k, t in buffers.items() if k == "sampled"),
                "dppo": sum(t.nbytes for t in buffers.values()),
            }
            times = {"trl": [], "dppo": []}
            memory, kept = {}, {}
            for _ in range(repeats):
                for name, path, prepare in (("trl", trl_path, same), ("dppo", dppo_path, fresh)):
                    seconds, memory[name], kept[name] = measure(path, prepare, data, topk, held[name])
                    times[name].append(seconds)
            row = {
                "backend": backend,
                "mode": mode,
                "tokens": tokens,
                "trl_s": min(times["trl"]),
                "dppo_s": min(times["dppo"]),
                "trl_s_all": times["trl"],
                "dppo_s_all": times["dppo"],
                "trl_bytes_per_token": memory["trl"] / tokens,
                "dppo_bytes_per_token": memory["dppo"] / tokens,
                "trl_kept_bytes_per_token": kept["trl"] / tokens,
                "dppo_kept_bytes_per_token": kept["dppo"] / tokens,
            }
            row["time_ratio"] = row["dppo_s"] / row["trl_s"]
            row["extra_bytes_per_token"] = row["dppo_bytes_per_token"] - row["trl_bytes_per_token"]
            row["extra_kept_bytes_per_token"] = row["dppo_kept_bytes_per_token"] - row["trl_kept_bytes_per_token"]
            rows.append(row)
            print(
                f"{backend:15s} {row['mode']:7s} {tokens:>8d} tokens: TRL {row['trl_s']:.3f} s, DPPO "
                f"{row['dppo_s']:.3f} s ({row['time_ratio']:.2f}x); {row['trl_bytes_per_token']:.0f} vs "
                f"{row['dppo_bytes_per_token']:.0f} B/token peak ({row['extra_bytes_per_token']:+.0f}), batch "
                f"tensors {row['extra_kept_bytes_per_token']:+.0f} B/token",
                flush=True,
            )
            del data, raw, completion_ids
    return rows


# ------------------------------------------------------------------------------------ the recorder in generate()


def generation_overhead(batch: int, new_tokens: int, repeats: int) -> dict:
    """`gpu_transformers.recorder_overhead` on the offline SmolLM2-135M-Instruct, fp32 on the CPU, at T = 0.7."""
    from gpu_transformers import recorder_overhead
    from transformers import AutoModelForCausalLM

    from trl_dppo.jobs.default_model import default_model_path

    model = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32).eval()
    prompt = torch.randint(100, 40000, (batch, 16), generator=torch.Generator().manual_seed(0))
    return recorder_overhead(model, prompt, new_tokens, repeats, temperature=0.7)


# ---------------------------------------------------------------------------------------------------- output


def write(rows, generation, out: Path, commands: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    results = {"scaling": rows, "generation": generation, "commands": commands}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    lines = [
        "# Record path cost against GRPOTrainer's own handling of the same log-probabilities",
        "",
        *(f"    {command}" for command in commands),
        "",
        "Peak: the resident memory's high-water mark during the path above where it started, plus the records",
        "that exist before it (transformers: the recorder's buffers; TRL's side, the sampled floats alone). Batch:",
        "the tensors the batch keeps afterwards (each storage once).",
        "",
        "| backend | mode | tokens | TRL s | DPPO s | time ratio | TRL peak B/token | DPPO peak B/token "
        "| extra peak B/token | extra batch B/token |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['backend']} | {r['mode']} | {r['tokens']:,} | {r['trl_s']:.3f} | {r['dppo_s']:.3f} | "
            f"{r['time_ratio']:.2f} | {r['trl_bytes_per_token']:.0f} | {r['dppo_bytes_per_token']:.0f} | "
            f"{r['extra_bytes_per_token']:+.0f} | {r['extra_kept_bytes_per_token']:+.0f} |"
        )
    if generation:
        lines += ["", "| generate() on SmolLM2-135M, 64 x 256 | median s | trials (s) | overhead |"]
        lines += ["|---|---:|---|---:|"]
        for name, g in generation.items():
            trials = ", ".join(f"{t:.1f}" for t in g["seconds"])
            lines.append(f"| {name} | {g['median_s']:.1f} | {trials} | {g['overhead']:+.1%} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = {
        "vllm": "-",
        "vllm server": (0, (5, 1, 1, 1)),
        "vllm colocate": "-.",
        "transformers": "--",
        "transformers R3": (0, (3, 1, 1, 1, 1, 1)),
    }
    colors = {"binary": "tab:blue", "top-20": "tab:orange", "top-20 vs TRL logprobs=0": "tab:red"}
    colors.update(zip((f"binary + routes, {shape}" for shape in MOE_SHAPES), ("tab:green", "tab:purple"), strict=True))
    for backend, mode in dict.fromkeys((r["backend"], r["mode"]) for r in rows):
        sel = [r for r in rows if r["backend"] == backend and r["mode"] == mode]
        x, style, color = [r["tokens"] for r in sel], styles[backend], colors[mode]
        line = {"linestyle": style, "marker": "o", "color": color}
        axes[0].plot(x, [r["dppo_s"] for r in sel], **line, label=f"DPPO {backend} {mode}")
        axes[0].plot(x, [r["trl_s"] for r in sel], **{**line, "marker": "x", "color": "gray"}, alpha=0.6)
        axes[1].plot(x, [r["dppo_bytes_per_token"] * r["tokens"] for r in sel], **line)
        axes[1].plot(
            x, [r["trl_bytes_per_token"] * r["tokens"] for r in sel], **{**line, "marker": "x", "color": "gray"}
        )
    xs = sorted({r["tokens"] for r in rows})
    for ax, label in ((axes[0], "seconds"), (axes[1], "peak bytes")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("sampled tokens per generation batch")
        ax.set_ylabel(label)
        ref = ax.get_lines()[0].get_ydata()[0]
        ax.plot(xs, [ref * x / xs[0] for x in xs], ":", color="black", label="linear")
    axes[0].set_title("record path time (gray: GRPOTrainer's own)")
    axes[1].set_title("record path memory (gray: GRPOTrainer's own)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "records_scaling.png", dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model-repeats", type=int, default=3, help="0 skips the SmolLM2 generation part")
    backends = list(dict.fromkeys(case[0] for case in CASES))
    parser.add_argument(
        "--backends", nargs="*", choices=backends, default=backends,
        help="a subset reruns those rows and keeps the others (and the generation part, unless rerun) of --out's "
        "results.json; none reruns the generation part alone",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/records_scaling"))
    args = parser.parse_args()
    commands = ["python benchmarks/records_scaling.py " + shlex.join(sys.argv[1:])]
    rows, generation = scaling(args.sizes, args.repeats, args.backends), {}
    if args.backends != backends and (args.out / "results.json").exists():
        kept = json.loads((args.out / "results.json").read_text())
        rows = [r for r in kept["scaling"] if r["backend"] not in args.backends] + rows
        generation, commands = kept["generation"], kept.get("commands", []) + commands
    write(rows, generation, args.out, commands)  # the scaling results are kept even if the generation part is cut
    if args.model_repeats:
        write(rows, generation_overhead(64, 256, args.model_repeats), args.out, commands)


if __name__ == "__main__":
    main()
