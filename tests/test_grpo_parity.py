"""DPPOTrainer against GRPOTrainer at learning rate 0, for each GRPOConfig option that changes GRPO's loss and that
DPPO inherits: both trainers score the same completions into the same batch, and with mu at pi (DPPO's weight
M * (pi/mu) * A is then A) DPPO's loss, gradient and evaluation loss equal GRPOTrainer's bit for bit."""

from __future__ import annotations

import pytest
import torch
from trl import GRPOConfig, GRPOTrainer

from trl_dppo import DPPOTrainer

from .conftest import make_trainer
from .multi_turn import force_on_first_turn


# One generation batch: two prompts, four completions each (make_trainer's num_generations)
GROUPS = (0, 1)
# Every other completion is forced to end at once; the others run into max_completion_length (10 tokens). With one
# length for all, the loss types would normalise alike (up to a constant) and, the advantages of a group summing to 0,
# every policy loss would be 0 (loss_type="grpo"'s is 0 whatever the lengths: its gradient is what compares)
ENDING = "Done.<|im_end|>"
# In DPPO's batch only: mu, and mu_base, which the sampler records beside mu when its processors do more than
# temperature (here the forcing processor)
DPPO_ONLY = {"sampling_per_token_logps", "sampler_base_logps"}

# Each case sets one option; the others keep GRPOConfig's defaults (loss_type="dapo", scale_rewards="group", no KL,
# no entropy term), which the "dapo" case runs alone
LOSS_OPTIONS = {
    **{f"loss_type={loss_type}": {"loss_type": loss_type} for loss_type in ("grpo", "bnpo", "dr_grpo", "luspo")},
    "loss_type=dapo, scale_rewards=group (the defaults)": {"loss_type": "dapo", "scale_rewards": "group"},
    "top_entropy_quantile=0.5": {"top_entropy_quantile": 0.5},
    "beta=0.1": {"beta": 0.1, "use_bias_correction_kl": False},
    "beta=0.1 bias-corrected": {"beta": 0.1, "use_bias_correction_kl": True},
    "entropy_coef=0.05": {"entropy_coef": 0.05},
    **{f"scale_rewards={scale}": {"scale_rewards": scale} for scale in ("batch", "none")},
    "mask_truncated_completions": {"mask_truncated_completions": True},
}  # fmt: skip


def make_pair(tmp_path, model_dir, prompts, tokenizer, **options) -> tuple[GRPOTrainer, DPPOTrainer]:
    """A GRPOTrainer and a DPPOTrainer with the same settings at learning rate 0, the same LoRA weights (lora_B drawn
    off 0, so that the lora_A matrices have a gradient and the reference model, the adapters disabled, differs from
    the policy: GRPO's KL term and its gradient are 0 at B = 0), in training mode, one micro-batch per step."""
    settings = dict(learning_rate=0.0, disable_dropout=True, **options)
    grpo = make_trainer(tmp_path / "grpo", model_dir, prompts, tokenizer, GRPOTrainer, GRPOConfig, **settings)
    dppo = make_trainer(tmp_path / "dppo", model_dir, prompts, tokenizer, **settings)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        pairs = zip(grpo.model.named_parameters(), dppo.model.named_parameters(), strict=True)
        for (name, grpo_param), (dppo_name, dppo_param) in pairs:
            assert name == dppo_name
            if "lora_B" in name:
                dppo_param.copy_(torch.randn(dppo_param.shape, generator=generator))
            grpo_param.copy_(dppo_param)
    for trainer in (grpo, dppo):
        force_on_first_turn(trainer.model, tokenizer, ENDING)
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1
    return grpo, dppo


def generate(trainer, prompts, seed: int = 0) -> dict:
    """The trainer's own generation batch of `GROUPS`, sampled from the same random state in either trainer."""
    torch.manual_seed(seed)
    return trainer._generate_and_score_completions([prompts[i] for i in GROUPS for _ in range(4)])


def policy_logps(trainer, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi of the batch's completion tokens and the entropies, from the forward the loss runs, without gradient."""
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    length = batch["completion_ids"].size(1)
    with torch.no_grad():
        logps, entropies, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, input_ids, attention_mask, length, compute_entropy=True
        )
    return logps, entropies


def with_mu_at_pi(trainer, batch: dict) -> dict:
    """The DPPO batch with mu set to the trainer's own log pi at these weights. The recorded mu is that to the
    rounding of two float32 forward passes (tests/test_trainer.py's first test) and 1 on the forced tokens; set to pi
    exactly, DPPO's ratio is exp(0) = 1, nothing is masked, and its weight M * (pi/mu) * A is A itself."""
    logps, _ = policy_logps(trainer, batch)
    batch["sampling_per_token_logps"] = logps
    if "sampler_base_logps" in batch:  # the divergence's mu_base (recorded beside mu under the forcing processor)
        batch["sampler_base_logps"] = logps.clone()
    return batch


def ended(trainer, batch: dict) -> torch.Tensor:
    """Which completions of `batch` ended with EOS (the others ran into max_completion_length)."""
    return (batch["completion_ids"] == trainer.processing_class.eos_token_id).any(-1)


def assert_same_batches(trainer, grpo_batch: dict, dppo_batch: dict, grpo_only: frozenset = frozenset()) -> None:
    """Both trainers scored the same completions into the same tensors (advantages, masks, reference log-probabilities,
    the loss's token count): the same float32 code on the same rewards and forward passes, so equal bit for bit."""
    assert dppo_batch.keys() - grpo_batch.keys() == DPPO_ONLY
    assert grpo_batch.keys() - dppo_batch.keys() == grpo_only
    assert torch.equal(dppo_batch["completion_ids"], grpo_batch["completion_ids"])
    for key in grpo_batch.keys() & dppo_batch.keys():
        assert torch.equal(torch.as_tensor(dppo_batch[key]), torch.as_tensor(grpo_batch[key])), key
    # The forcing took: some completions ended, the others were truncated
    assert ended(trainer, dppo_batch).any() and not ended(trainer, dppo_batch).all()


def loss_and_gradient(trainer, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`compute_loss` on `batch` (the trainer's own, passed as GRPOTrainer's buffer passes it) and the gradient of
    every trainable parameter."""
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.requires_grad}
    return loss.detach(), grads


def assert_same_loss_and_gradient(grpo, dppo) -> None:
    """Equal bit for bit, tolerance 0: with pi = mu DPPO hands GRPOTrainer's loss w = 1 * exp(0) * A = A exactly,
    and GRPOTrainer's loss then runs the same float32 operations in the same order on identical tensors in both
    trainers (the loss's forward is the same deterministic computation each time). Any difference, an ulp included,
    is DPPO computing something GRPOTrainer does not."""
    (grpo_loss, grpo_grads), (dppo_loss, dppo_grads) = grpo, dppo
    assert torch.equal(dppo_loss, grpo_loss), (dppo_loss.item(), grpo_loss.item())
    assert dppo_grads.keys() == grpo_grads.keys()
    for name, grad in grpo_grads.items():
        assert grad.abs().max() > 0, name  # every LoRA tensor has a gradient to compare
        assert torch.equal(dppo_grads[name], grad), (name, (dppo_grads[name] - grad).abs().max().item())


@pytest.mark.parametrize("options", LOSS_OPTIONS.values(), ids=LOSS_OPTIONS.keys())
def test_loss_and_gradient_are_grpos_under_each_loss_option(tmp_path, tiny_model_dir, prompts, tokenizer, options):
    """On one generation batch that both trainers scored from the same completions, DPPO's loss and LoRA gradient are
    GRPOTrainer's under each loss type, the entropy mask, the KL term (with and without GRPO's bias correction), the
    entropy bonus, each reward scaling and the truncated-completion mask."""
    grpo, dppo = make_pair(tmp_path, tiny_model_dir, prompts, tokenizer, **options)
    grpo_batch, dppo_batch = generate(grpo, prompts), generate(dppo, prompts)
    assert_same_batches(dppo, grpo_batch, dppo_batch)
    if options.get("mask_truncated_completions"):  # the truncated completions left the loss whole
        assert not dppo_batch["completion_mask"][~ended(dppo, dppo_batch)].any()
    dppo_batch = with_mu_at_pi(dppo, dppo_batch)
    assert_same_loss_and_gradient(loss_and_gradient(grpo, grpo_batch), loss_and_gradient(dppo, dppo_batch))


def test_adaptive_entropy_control_moves_the_same_in_both(tmp_path, tiny_model_dir, prompts, tokenizer):
    """`use_adaptive_entropy`: the first loss applies no bonus (no entropy measured yet) and moves the coefficient by
    entropy_coef_delta (the entropy is below the target); the second applies it. Over both, DPPO's losses, gradients
    and controller state are GRPOTrainer's."""
    options = dict(
        use_adaptive_entropy=True,
        entropy_coef=0.01,
        entropy_coef_delta=0.05,
        entropy_coef_min=0.0,
        entropy_coef_max=0.5,
        entropy_target=100.0,  # above any entropy over SmolLM2's 49k tokens (at most log 49152 = 10.8 nats)
    )
    grpo, dppo = make_pair(tmp_path, tiny_model_dir, prompts, tokenizer, **options)
    grpo_batch, dppo_batch = generate(grpo, prompts), generate(dppo, prompts)
    assert_same_batches(dppo, grpo_batch, dppo_batch)
    dppo_batch = with_mu_at_pi(dppo, dppo_batch)
    losses = []
    for _ in range(2):
        grpo_result, dppo_result = loss_and_gradient(grpo, grpo_batch), loss_and_gradient(dppo, dppo_batch)
        assert_same_loss_and_gradient(grpo_result, dppo_result)
        assert (dppo.entropy_coef, dppo._last_world_entropy) == (grpo.entropy_coef, grpo._last_world_entropy)
        losses.append(dppo_result[0])
    assert dppo.entropy_coef == pytest.approx(0.01 + 2 * 0.05)
    assert losses[1] < losses[0]  # the bonus applied the second time: the controller acted on the loss


def test_a_batch_reused_over_num_iterations_has_grpos_loss_and_gradient(tmp_path, tiny_model_dir, prompts, tokenizer):
    """num_iterations=2, with the bias-corrected KL term: GRPOTrainer recomputes old log-probabilities while scoring,
    DPPO does not, and both passes over the buffered batch give GRPOTrainer's loss and gradient. DPPOConfig warns, as
    documented: after an update GRPOTrainer weights the KL term by pi/pi_old and DPPO's ratio reads 1. At learning
    rate 0 pi_old is pi and the two agree, which is what this shows; they part only once the weights move."""
    with pytest.warns(UserWarning, match="use_bias_correction_kl=True"):
        grpo, dppo = make_pair(
            tmp_path, tiny_model_dir, prompts, tokenizer, num_iterations=2, beta=0.1, use_bias_correction_kl=True
        )
    grpo_batch, dppo_batch = generate(grpo, prompts), generate(dppo, prompts)
    assert_same_batches(dppo, grpo_batch, dppo_batch, grpo_only=frozenset({"old_per_token_logps"}))
    dppo_batch = with_mu_at_pi(dppo, dppo_batch)
    for _ in range(2):  # each pass on the same batch dict, as GRPOTrainer's buffer hands it out again
        assert_same_loss_and_gradient(loss_and_gradient(grpo, grpo_batch), loss_and_gradient(dppo, dppo_batch))


def test_evaluation_loss_is_grpos(tmp_path, tiny_model_dir, prompts, tokenizer):
    """`evaluate()` with an eval_dataset: each trainer generates and scores the same completions in eval mode, and
    DPPO's eval_loss is GRPOTrainer's (bit for bit, with mu set to pi as in training: see `with_mu_at_pi`)."""
    eval_dataset = prompts.select(GROUPS)
    grpo, dppo = make_pair(tmp_path, tiny_model_dir, prompts, tokenizer, trainer_kwargs={"eval_dataset": eval_dataset})
    batches = {"grpo": [], "dppo": []}
    for name, trainer in (("grpo", grpo), ("dppo", dppo)):
        score = trainer._generate_and_score_completions

        def scored(inputs, score=score, trainer=trainer, seen=batches[name]):
            batch = score(inputs)
            if trainer is dppo:
                batch = with_mu_at_pi(trainer, batch)
            seen.append(dict(batch))
            return batch

        trainer._generate_and_score_completions = scored
    torch.manual_seed(0)
    grpo_metrics = grpo.evaluate()
    torch.manual_seed(0)
    dppo_metrics = dppo.evaluate()
    assert len(batches["grpo"]) == len(batches["dppo"]) == 1  # one eval batch of 2 prompts x 4 completions
    assert_same_batches(dppo, batches["grpo"][0], batches["dppo"][0])
    assert grpo_metrics["eval_loss"] != 0
    # Tolerance 0, for the reason `assert_same_loss_and_gradient` gives
    assert dppo_metrics["eval_loss"] == grpo_metrics["eval_loss"], (dppo_metrics, grpo_metrics)
    assert "eval_trust_region/masked_fraction" in dppo_metrics  # it was DPPO's loss that ran


def test_trust_region_rates_count_the_loss_tokens_the_entropy_mask_leaves_out(
    tmp_path, tiny_model_dir, prompts, tokenizer
):
    """With top_entropy_quantile < 1 GRPOTrainer's entropy mask takes low-entropy tokens out of the gradient after
    DPPO's trust region has run: the `trust_region/*` rates count over every loss token, those included
    (docs/metrics.md)."""
    _, dppo = make_pair(tmp_path, tiny_model_dir, prompts, tokenizer, top_entropy_quantile=0.5)
    batch = generate(dppo, prompts)
    mask = batch["completion_mask"].bool()
    _, entropies = policy_logps(dppo, batch)
    entropy_mask = dppo.get_high_entropy_mask(entropies, mask.long(), 0.5).bool() & mask
    assert 0 < entropy_mask.sum() < mask.sum()
    dppo.compute_loss(dppo.model, batch)
    _, tokens = dppo._metrics["train"]["trust_region/masked_fraction"][-1]
    assert tokens == mask.sum()
