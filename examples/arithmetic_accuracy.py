"""Exact-answer accuracy of a model on the main job's arithmetic prompts, sampled like the trainer samples.

    python examples/arithmetic_accuracy.py                                  # SmolLM2-135M-Instruct, 64 prompts
    python examples/arithmetic_accuracy.py --model runs/math --num_prompts 64   # a saved model or LoRA adapter

Prompts come from a seed the training data does not use by default (--prompt_seed 12345), sampled with
transformers' `generate` at temperature 1.0 (no top-k/top-p), --max_new_tokens 32 as in the main job.
"""

from __future__ import annotations

import argparse
import os
import time


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see dppo_math_lora.py

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from trl_dppo.jobs.arithmetic import arithmetic_dataset, exact_answer_reward  # noqa: E402
from trl_dppo.jobs.default_model import DEFAULT_MODEL, resolve_model  # noqa: E402


def load(name_or_path: str) -> tuple[torch.nn.Module, object]:
    """Load a causal LM, or a PEFT adapter folder on top of its base model."""
    path = resolve_model(name_or_path)
    if os.path.isfile(os.path.join(path, "adapter_config.json")):
        from peft import AutoPeftModelForCausalLM

        model = AutoPeftModelForCausalLM.from_pretrained(path)
    else:
        model = AutoModelForCausalLM.from_pretrained(path)
    return model.eval(), AutoTokenizer.from_pretrained(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--num_prompts", type=int, default=64)
    parser.add_argument("--prompt_seed", type=int, default=12345)
    parser.add_argument("--min_value", type=int, default=1)
    parser.add_argument("--max_value", type=int, default=20)
    parser.add_argument("--max_new_tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--show", type=int, default=0, help="print this many prompts and completions")
    args = parser.parse_args()

    model, tokenizer = load(args.model)
    tokenizer.padding_side = "left"
    data = arithmetic_dataset(
        args.num_prompts, seed=args.prompt_seed, min_value=args.min_value, max_value=args.max_value
    )
    torch.manual_seed(args.seed)
    start, rewards, lengths = time.time(), [], []
    for i in range(0, len(data), args.batch_size):
        batch = data[i : i + args.batch_size]
        inputs = tokenizer.apply_chat_template(
            batch["prompt"], add_generation_prompt=True, padding=True, return_tensors="pt", return_dict=True
        )
        with torch.no_grad():
            output = model.generate(
                **inputs,
                do_sample=True,
                temperature=args.temperature,
                top_k=0,
                top_p=1.0,
                max_new_tokens=args.max_new_tokens,
                pad_token_id=tokenizer.pad_token_id,
            )
        completion_ids = output[:, inputs["input_ids"].shape[1] :]
        texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        rewards += exact_answer_reward(texts, batch["answer"])
        shown = list(zip(batch["prompt"], texts, batch["answer"], strict=True))[: max(0, args.show - i)]
        for prompt, text, answer in shown:
            print(f"{prompt[-1]['content']!r} [{answer}] -> {text!r}")
        lengths += (completion_ids != tokenizer.pad_token_id).sum(1).tolist()
    accuracy = sum(rewards) / len(rewards)
    print(
        f"model {args.model}: exact-answer accuracy {accuracy:.3f} ({int(sum(rewards))}/{len(rewards)}), "
        f"mean completion length {sum(lengths) / len(lengths):.1f} tokens, temperature {args.temperature}, "
        f"{time.time() - start:.0f} s"
    )


if __name__ == "__main__":
    main()
