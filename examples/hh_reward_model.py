"""Train an HH-RLHF reward model with TRL's RewardTrainer: LoRA on SmolLM2-135M-Instruct (offline default) as a
one-output sequence classifier, on preference pairs, with a held-out split it never trains on.

    python examples/hh_reward_model.py --data_path ../shared/data/hh-rlhf/harmless-base-test.jsonl.gz \
        --output_dir runs/hh

writes the merged model and its tokenizer to runs/hh/reward_model/ and prints its held-out pairwise accuracy beside
the untrained backbone's (reward_summary.json). It is an ordinary reward model:

    python examples/hh_rlhf_lora.py --reward_model_name_or_path runs/hh/reward_model \
        --data_path ../shared/data/hh-rlhf/harmless-base-test.jsonl.gz

The split is the pipeline's, so `python -m trl_dppo.jobs.hh_pipeline` with the same --output_dir and data arguments
reuses this reward model and trains DPPO on prompts it never saw (all arguments: --help).
"""

from trl_dppo.jobs.hh_pipeline import reward_model_main


if __name__ == "__main__":
    reward_model_main()
