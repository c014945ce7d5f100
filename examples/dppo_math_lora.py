"""The main job: DPPO with LoRA on verifiable arithmetic (`trl-dppo math`, same arguments).

The job lives in `trl_dppo/jobs/dppo_math_lora.py` (its docstring is the manual); this file keeps
`python examples/dppo_math_lora.py ...` and `accelerate launch examples/dppo_math_lora.py ...` working.
"""

import os


# OpenMP threads that spin while waiting make small CPU matmuls 10-20x slower whenever another process shares the
# cores; passive waiting costs nothing when the machine is idle. Read when torch loads, so set before importing it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from trl_dppo.jobs.dppo_math_lora import cli  # noqa: E402


if __name__ == "__main__":
    cli()
