"""Custom rollouts (`rollout_func`): mu is what the function returns, with a binary divergence only."""

from __future__ import annotations

import pytest
import torch

from .conftest import make_trainer, spy_on_trust_region


class SamplingRollout:
    """A rollout_func that samples from the trained model and returns its real log-probabilities (fp32)."""

    def __init__(self, logprobs_key: str = "logprobs"):
        self.logprobs_key = logprobs_key
        self.returned: dict[tuple[int, ...], list[float]] = {}  # prompt + completion ids -> log-probs returned

    def __call__(self, prompts, trainer):
        tokenizer = trainer.processing_class
        model = trainer.accelerator.unwrap_model(trainer.model)
        prompt_ids, completion_ids, logprobs = [], [], []
        for prompt in prompts:
            ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
            ids = torch.tensor([ids])
            with torch.no_grad():
                sequence = model.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=True,
                    top_k=0,
                    top_p=1.0,
                    temperature=1.0,
                    max_new_tokens=trainer.max_completion_length,
                    pad_token_id=tokenizer.pad_token_id,
                    eos_token_id=tokenizer.eos_token_id,
                )
                completion = sequence[0, ids.size(1) :]
                stop = (completion == tokenizer.eos_token_id).nonzero()
                completion = completion[: stop[0, 0] + 1] if len(stop) else completion
                full = torch.cat([ids[0], completion])[None]
                logits = model(input_ids=full).logits[0, ids.size(1) - 1 : -1].float()
                logps = torch.log_softmax(logits, -1).gather(-1, completion[:, None]).squeeze(-1).tolist()
            prompt_ids.append(ids[0].tolist())
            completion_ids.append(completion.tolist())
            logprobs.append(logps)
            self.returned[tuple(ids[0].tolist() + completion.tolist())] = logps
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, self.logprobs_key: logprobs}


def rollout_trainer(tmp_path, model_dir, prompts, tokenizer, rollout_func, **overrides):
    """`test_trainer.make_trainer` at learning rate 0, with the rollout_func."""
    settings = dict(learning_rate=0.0, trainer_kwargs={"rollout_func": rollout_func})
    settings.update(overrides)
    return make_trainer(tmp_path, model_dir, prompts, tokenizer, **settings)


def test_rollout_func_logprobs_reach_the_binary_trust_region_unchanged(tmp_path, tiny_model_dir, prompts, tokenizer):
    rollout = SamplingRollout()
    trainer = rollout_trainer(tmp_path, tiny_model_dir, prompts, tokenizer, rollout)
    seen = spy_on_trust_region(trainer)
    trainer.train()
    assert len(seen) == 2
    for mu, pi, mask, inputs in seen:
        for row in range(mu.size(0)):
            prompt = inputs["prompt_ids"][row][inputs["prompt_mask"][row].bool()].tolist()
            completion = inputs["completion_ids"][row][inputs["completion_mask"][row].bool()].tolist()
            returned = torch.tensor(rollout.returned[tuple(prompt + completion)])
            assert torch.equal(mu[row][mask[row]], returned)
        # At learning rate 0 the returned log-probs are the trainer's own: pi agrees with them token by token
        assert (mu.exp() - pi.exp()).abs()[mask].max() < 1e-4
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert all(entry["mismatch/missing_sampler_logps"] == 0 for entry in logs)


def test_rollout_func_with_a_topk_divergence_is_refused_at_start(tmp_path, tiny_model_dir, prompts, tokenizer):
    with pytest.raises(ValueError, match="rollout_func.*binary divergence"):
        rollout_trainer(
            tmp_path, tiny_model_dir, prompts, tokenizer, SamplingRollout(), divergence="topk_tv", divergence_topk=5
        )


def test_rollout_func_without_logprobs_stops_with_a_clear_error(tmp_path, tiny_model_dir, prompts, tokenizer):
    def no_logprobs(prompts, trainer):
        output = SamplingRollout()(prompts, trainer)
        output["logprobs"] = None
        return output

    trainer = rollout_trainer(tmp_path, tiny_model_dir, prompts, tokenizer, no_logprobs, max_steps=1)
    with pytest.raises(RuntimeError, match="must return them under 'logprobs': one list per completion"):
        trainer.train()


@pytest.mark.parametrize("change", [-1, 1], ids=["shorter", "longer"])
def test_rollout_func_logprobs_of_the_wrong_length_stop_the_first_batch(
    tmp_path, tiny_model_dir, prompts, tokenizer, change
):
    def wrong_length(prompts, trainer):
        output = SamplingRollout()(prompts, trainer)
        logps = output["logprobs"][2]
        output["logprobs"][2] = logps[:-1] if change < 0 else [*logps, -1.0]
        wrong_length.lengths = (len(output["completion_ids"][2]), len(output["logprobs"][2]))
        return output

    trainer = rollout_trainer(tmp_path, tiny_model_dir, prompts, tokenizer, wrong_length, max_steps=1)
    with pytest.raises(ValueError, match=r"log-probabilities for completion 2 of the batch") as error:
        trainer.train()
    tokens, logps = wrong_length.lengths
    assert f"returned {logps} log-probabilities for completion 2 of the batch, which has {tokens} tokens" in str(
        error.value
    )
    assert trainer.state.global_step == 0
