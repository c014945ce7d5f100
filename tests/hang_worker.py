"""A launched run that deadlocks on purpose, for tests/test_process_bounds.py: every process writes its pid, then the
main process waits in a collective (gloo's barrier) that the other never joins, since it sleeps.

    python tests/hang_worker.py PID_DIR
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch.distributed as dist


def sleep_instead_of_the_barrier() -> None:
    time.sleep(3600)


def main(pid_dir: str) -> None:
    dist.init_process_group("gloo")
    Path(pid_dir, f"rank{dist.get_rank()}").write_text(str(os.getpid()))
    if dist.get_rank() == 0:
        dist.barrier()
    else:
        sleep_instead_of_the_barrier()


if __name__ == "__main__":
    main(sys.argv[1])
