"""A run of several CPU processes resumes its optimizer state: transformers loads it with `map_location=args.device`,
which accelerate makes `cpu:0` on every process of a multi-process CPU launch, and torch restores "cpu" only.
(The resume itself, two processes and two machines: tests/test_kill_and_resume.py.)"""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_optimizer_state_loads_onto_an_indexed_cpu_device_once_accepted(tmp_path):
    # In a fresh interpreter: the deserializer is registered once per process, for good
    script = textwrap.dedent(f"""
        import torch
        from trl_dppo.checkpoint_loading import accept_indexed_cpu_device
        path = {str(tmp_path / "optimizer.pt")!r}
        torch.save({{"exp_avg": torch.arange(4.0)}}, path)
        try:
            torch.load(path, map_location=torch.device("cpu", 0))
        except RuntimeError as error:
            assert "tagged with cpu:0" in str(error), error
        else:
            raise AssertionError("torch restored cpu:0 by itself: the workaround is no longer needed")
        accept_indexed_cpu_device(torch.device("cuda", 0))  # another device: nothing registered
        accept_indexed_cpu_device(torch.device("cpu"))  # no index: torch restores it itself
        accept_indexed_cpu_device(torch.device("cpu", 0))
        accept_indexed_cpu_device(torch.device("cpu", 0))  # twice: once registered
        loaded = torch.load(path, map_location=torch.device("cpu", 0))
        assert torch.equal(loaded["exp_avg"], torch.arange(4.0)) and loaded["exp_avg"].device.type == "cpu"
        assert torch.load(path, map_location="cpu")["exp_avg"].device.type == "cpu"
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
