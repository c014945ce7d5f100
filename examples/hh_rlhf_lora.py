"""DPPO with LoRA on HH-RLHF prompts and a reward model (`trl-dppo hh-rlhf`, same arguments).

The job lives in `trl_dppo/jobs/hh_rlhf_lora.py` (its docstring gives the paper-scale GPU command); this file keeps
`python examples/hh_rlhf_lora.py ...` and `accelerate launch examples/hh_rlhf_lora.py ...` working.
"""

import os


os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see dppo_math_lora.py: spinning OpenMP threads stall shared CPUs

from trl_dppo.jobs.hh_rlhf_lora import cli  # noqa: E402


if __name__ == "__main__":
    cli()
