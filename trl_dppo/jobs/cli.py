"""`trl-dppo`: the jobs this package ships, as subcommands in the manner of TRL's `trl` command.

    trl-dppo math [ARGS]        DPPO + LoRA on arithmetic (the main job; examples/dppo_math_lora.py)
    trl-dppo hh-rlhf [ARGS]     DPPO + LoRA on HH-RLHF prompts with a reward model (examples/hh_rlhf_lora.py)
    trl-dppo hh [ARGS]          a reward model and a judge on HH preference pairs, then DPPO against the reward model,
                                judged on held-out prompts (trl_dppo.jobs.hh_pipeline)
    trl-dppo hh-reward-model    that pipeline's reward model and judge alone
    trl-dppo plot RUN [--out]   the plots of a run (python -m trl_dppo.jobs.plots)

The training jobs take TRL-style flags (every DPPOConfig and ModelConfig field, and the job's own) and `--config
FILE.yaml`, as `trl grpo` does; `trl-dppo COMMAND --help` lists them. On several processes:
`accelerate launch [--config_file ...] -m trl_dppo.jobs.cli COMMAND ...`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence


# command -> (module, its function taking the remaining arguments, one-line help)
COMMANDS = {
    "math": ("trl_dppo.jobs.dppo_math_lora", "cli", "DPPO + LoRA on verifiable arithmetic (the main job)"),
    "hh-rlhf": ("trl_dppo.jobs.hh_rlhf_lora", "cli", "DPPO + LoRA on HH-RLHF prompts scored by a reward model"),
    "hh": ("trl_dppo.jobs.hh_pipeline", "main", "HH-RLHF end to end: reward model and judge, DPPO, held-out measures"),
    "hh-reward-model": ("trl_dppo.jobs.hh_pipeline", "reward_model_main", "the HH pipeline's reward model and judge"),
    "plot": ("trl_dppo.jobs.plots", "main", "draw the plots of a run from its output_dir or log history"),
}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="trl-dppo",
        description="DPPO (Divergence Proximal Policy Optimization) jobs for Hugging Face TRL.",
        epilog="`trl-dppo COMMAND --help` lists a command's arguments.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, _, help_text) in COMMANDS.items():
        # The command's own parser (a TrlParser, or the plot's) reads the rest, --help included
        commands.add_parser(name, help=help_text, add_help=False)
    args, rest = parser.parse_known_args(argv)
    module, function, _ = COMMANDS[args.command]
    getattr(importlib.import_module(module), function)(rest)


if __name__ == "__main__":
    main(sys.argv[1:])
