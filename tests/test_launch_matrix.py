"""Two processes on transformers generation, for real: each samples its own completions with `generate()`, records mu
on its own rows, and the step's update is the one a single process makes from the same global batch.

`tests/launch_worker.py` trains one optimizer step under `accelerate launch` (examples/accelerate_configs/cpu_2proc.yaml,
gloo) and again in one process on the two processes' generation batch stacked in process order. The vLLM cells of the
same matrix are in tests/test_vllm_launches.py (colocate) and tests/test_vllm_server.py (server); docs/distributed.md lists every
cell with its test.
"""

from __future__ import annotations

import pytest
import torch

from .conftest import assert_updates_agree, tiny_model_logprob_atol, two_processes_then_one


# Also on the newest and oldest stacks (.ci/run's stage 4): the one launch there
pytestmark = [pytest.mark.slow, pytest.mark.launch, pytest.mark.ranges]

RUNS = {
    "transformers-binary_tv": {"divergence": "binary_tv"},
    "transformers-topk_tv": {"divergence": "topk_tv"},
}


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    return two_processes_then_one(
        tmp_path_factory.mktemp("launch-transformers"), {"model_dir": tiny_model_dir, "runs": RUNS}
    )


@pytest.mark.parametrize("name", list(RUNS))
def test_each_of_two_processes_records_the_mu_its_generate_sampled_from(runs, name, tokenizer):
    two, _ = runs
    run = two[name]
    assert run["num_processes"] == 2 and len(run["seen"]) == 2
    for seen in run["seen"]:
        ((mu, pi, mask),) = seen  # one loss computation per process, before the update: pi is the sampler's model
        # fp32 on both sides: the two forward passes of one model differ by float reassociation alone
        torch.testing.assert_close(mu[mask], pi[mask], rtol=0, atol=tiny_model_logprob_atol(tokenizer, pi[mask]))
        # ... and a wrong mu (the neighbouring token's) is far beyond that
        shifted = (mu[:, 1:] - pi[:, :-1]).abs()[mask[:, 1:] & mask[:, :-1]]
        assert shifted.mean() > 1.0
    # the processes sampled different rows of the global batch
    first, second = (seen[0][0] for seen in run["seen"])
    assert not torch.equal(first, second)


@pytest.mark.parametrize("name", list(RUNS))
def test_two_processes_make_the_update_one_process_makes_from_the_same_batch(runs, name):
    two, one = runs
    assert one[name]["num_processes"] == 1
    for param, before in two[name]["before"].items():
        torch.testing.assert_close(one[name]["before"][param], before, rtol=0, atol=0)
    assert_updates_agree(two[name]["before"], one[name]["update"], two[name]["update"])
