"""The HH-RLHF study on CPU: a reward model from HH preference pairs, then DPPO with LoRA against it, two seeds.

    python benchmarks/hh_rlhf_study.py                      # the shared sample, offline; extra arguments go to
                                                            # trl_dppo.jobs.hh_pipeline (e.g. --seeds 0 1 2)

runs `trl_dppo.jobs.hh_pipeline` on ../shared/data/hh-rlhf/harmless-base-test.jsonl.gz into runs/hh-rlhf-study (reward
model and LoRA adapters there, not committed) and copies the small results into benchmarks/results/hh_rlhf/:
summary.json, samples.md, the reward model's reward_summary.json, and each seed's dppo_summary.json and plots.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from trl_dppo.jobs.hh_pipeline import main


# Relative to the project's root, so the command recorded in summary.json is the one to type there
DATA = "../shared/data/hh-rlhf/harmless-base-test.jsonl.gz"
OUTPUT = Path("runs/hh-rlhf-study")
RESULTS = Path("benchmarks/results/hh_rlhf")

if __name__ == "__main__":
    os.chdir(Path(__file__).resolve().parents[1])
    summary = main(["--data_path", DATA, "--output_dir", str(OUTPUT), *sys.argv[1:]])
    RESULTS.mkdir(parents=True, exist_ok=True)
    for name in ("summary.json", "samples.md", "reward_model/reward_summary.json"):
        shutil.copy(OUTPUT / name, RESULTS / Path(name).name)
    for seed in summary["policy"]["seeds"]:
        shutil.copy(OUTPUT / f"seed{seed}/dppo_summary.json", RESULTS / f"seed{seed}.dppo_summary.json")
        shutil.copytree(OUTPUT / f"seed{seed}/plots", RESULTS / f"seed{seed}_plots", dirs_exist_ok=True)
    print(f"Results copied to {RESULTS}")
