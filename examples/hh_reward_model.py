"""Train two HH-RLHF reward models with TRL's RewardTrainer, a reward model and a judge: LoRA on SmolLM2-135M-Instruct
(offline default) as one-output sequence classifiers, each on its own preference pairs, with a held-out split neither
trains on.

    python examples/hh_reward_model.py --data_path ../shared/data/hh-rlhf/harmless-base-test.jsonl.gz \
        --output_dir runs/hh

writes each merged model and its tokenizer to runs/hh/reward_model/ and runs/hh/judge/ and prints its held-out
pairwise accuracy beside the untrained backbone's (reward_summary.json). Each is an ordinary reward model:

    python examples/hh_rlhf_lora.py --reward_model_name_or_path runs/hh/reward_model \
        --data_path ../shared/data/hh-rlhf/harmless-base-test.jsonl.gz

The split is the pipeline's, so `python -m trl_dppo.jobs.hh_pipeline` with the same --output_dir (or
--reward_models_dir) and data arguments reuses both, trains DPPO against the reward model on prompts neither saw, and
judges the policy with the judge (all arguments: --help).
"""

from trl_dppo.jobs.hh_pipeline import reward_model_main


if __name__ == "__main__":
    reward_model_main()
