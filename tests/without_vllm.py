"""Runs a launched worker script as in an environment without vLLM, for the launches that never generate with it:
TRL then skips its import of vLLM, 4-5 s of each process's start on 2 cores. A `None` in `sys.modules` is what
`importlib.util.find_spec`, and so TRL's `is_vllm_available`, reads as not installed.

    python tests/without_vllm.py SCRIPT [ARGUMENTS...]
"""

from __future__ import annotations

import runpy
import sys


if __name__ == "__main__":
    sys.modules["vllm"] = None
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
