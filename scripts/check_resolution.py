"""Whether pip can install the built wheel beside the stacks TRL users have, and beside each vLLM minor release.

Each check is pip's resolver on PyPI's metadata (`pip install --dry-run --ignore-installed --report`). pip reads each
wheel's metadata by HTTP range requests (`--use-feature=fast-deps`): where the index serves no separate metadata file
(PEP 658), as the mirror these machines and CI use, a plain dry run downloads every wheel it resolves, a CUDA torch
stack about 3 GB per check, enough to fill CI's disk. A user stack is pinned exactly next to the wheel: it
resolves only if the wheel's ranges accept every one of its versions, i.e. installing the wheel into that environment
changes none of them. pip reads PyPI alone, as on a user's machine: this machine's pip configuration (a local
wheel of the CPU torch, a constraint capping torch at 2.14.1) is left out. A vLLM check asks for the wheel's `[vllm]` extra with one vLLM minor release and records the
torch and transformers pip picks (each vLLM release pins one torch); the `[deepspeed]` extra is checked beside the
user stacks. Exits 1 if anything that should resolve does not.

Usage: python scripts/check_resolution.py dist/trl_dppo-VERSION-py3-none-any.whl [--vllm] [--write docs/resolution.md]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path


# Exactly the oldest-supported environment scripts/test_oldest.sh builds and tests (its torch a CUDA build)
OLDEST = {
    "torch": "2.11.0",
    "transformers": "5.17.0",
    "accelerate": "1.13.0",
    "peft": "0.18.0",
    "datasets": "4.7.0",
    "trl": "1.16.0",
    "numpy": "1.26.4",
    "huggingface_hub": "1.5.0",
    "pyarrow": "21.0.0",
}
# The newest releases on PyPI when this list was last raised (scripts/test_latest.sh tests them with torch 2.13,
# the only CPU build on these machines)
NEWEST = {
    "torch": "2.14.1",
    "transformers": "5.24.0",
    "accelerate": "1.15.0",
    "peft": "0.21.2",
    "datasets": "5.2.0",
    "trl": "1.16.0",
}
# TRL 1.16's vLLM range (trl.import_utils), which the `[vllm]` extra promises
VLLM_MINORS = [f"0.{minor}" for minor in range(22, 32)]


# Where these machines point pip at local wheels and indexes or constrain it (/etc/xdg/pip, PIP_FIND_LINKS)
PIP_SETTINGS_OF_THIS_MACHINE = {"PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_CONSTRAINT"}


@dataclass
class Check:
    name: str
    pins: dict[str, str]
    extra: str = ""
    resolved: dict[str, str] = field(default_factory=dict)
    error: str = ""


def checks(with_vllm: bool) -> list[Check]:
    user = {"torch": "2.11.0", "transformers": "5.17.0", "accelerate": "1.15.0", "peft": "0.21.2", "trl": "1.16.0"}
    stacks = [
        Check("a TRL user's GPU machine (torch 2.11, CUDA 13)", user),
        Check("oldest supported (scripts/test_oldest.sh)", OLDEST),
        Check("newest releases", NEWEST),
        Check("newest releases, torch 2.15", {**NEWEST, "torch": "2.15.0"}),
        # the `[deepspeed]` extra beside those stacks: the DeepSpeed release tests/test_zero.py runs (the newest)
        Check("a TRL user's GPU machine, DeepSpeed", {**user, "deepspeed": "0.19.8"}, extra="[deepspeed]"),
        Check("oldest supported, DeepSpeed", {**OLDEST, "deepspeed": "0.19.8"}, extra="[deepspeed]"),
        Check("newest releases, DeepSpeed", {**NEWEST, "deepspeed": "0.19.8"}, extra="[deepspeed]"),
    ]
    vllm = [Check(f"vLLM {minor}", {"vllm": f"{minor}.*"}, extra="[vllm]") for minor in VLLM_MINORS]
    return stacks + vllm if with_vllm else stacks


def resolve(wheel: Path, check: Check) -> Check:
    requirements = [f"{wheel}{check.extra}"] + [f"{name}=={version}" for name, version in check.pins.items()]
    env = {key: value for key, value in os.environ.items() if key not in PIP_SETTINGS_OF_THIS_MACHINE}
    env["PIP_CONFIG_FILE"] = os.devnull
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet"]
        command += ["--use-feature=fast-deps"]
        command += ["--disable-pip-version-check", "--report", str(report), *requirements]
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            lines = [line for line in done.stderr.splitlines() if line.startswith("ERROR") or "conflict" in line]
            check.error = " ".join(lines)[:400] or done.stderr[-400:]
            return check
        installed = json.loads(report.read_text())["install"]
    check.resolved = {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in installed}
    for name, version in check.pins.items():
        got = check.resolved.get(name)
        if got is None or not (got == version or (version.endswith("*") and got.startswith(version[:-1]))):
            check.error = f"{name}: asked for {version}, pip picked {got}"
    return check


def table(results: list[Check]) -> str:
    shown = ["torch", "transformers", "accelerate", "peft", "datasets", "trl", "vllm", "deepspeed"]
    rows = ["| next to the wheel | resolves | " + " | ".join(shown) + " |", "|---" * (len(shown) + 2) + "|"]
    for check in results:
        verdict = "yes" if not check.error else f"**no**: {check.error}"
        versions = [check.resolved.get(name, "") for name in shown]
        rows.append(
            f"| {check.name}{' `' + check.extra + '`' if check.extra else ''} | {verdict} | "
            + " | ".join(versions)
            + " |"
        )
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheel", type=Path)
    # pip's resolver spends about 30 s of CPU on vLLM's dependency tree, per minor: docs/resolution.md records them,
    # CI checks the user stacks
    parser.add_argument("--vllm", action="store_true", help="also each vLLM minor release of the [vllm] extra")
    parser.add_argument("--write", type=Path, help="also write the table as a markdown report")
    args = parser.parse_args()
    wheel = args.wheel.resolve()
    # Metadata requests only; a few at once keeps the whole check near the time of its slowest one
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda check: resolve(wheel, check), checks(args.vllm)))
    report = table(results)
    print(report)
    if args.write:
        about = (
            f"Written by `python scripts/check_resolution.py {wheel.name}{' --vllm' if args.vllm else ''} --write "
            f"{args.write}` (pip's resolver, a dry run on PyPI's metadata; `.ci/run` checks the pinned stacks). A "
            "pinned stack resolves only if installing the wheel into it changes none of its versions. A vLLM row "
            "shows the torch and transformers pip picks beside that vLLM minor release; a DeepSpeed row adds the "
            "`[deepspeed]` extra with the DeepSpeed release the ZeRO tests run."
        )
        header = "# What pip resolves next to the wheel\n\n" + textwrap.fill(about, 119, break_on_hyphens=False)
        args.write.write_text(f"{header}\n\n{report}\n")
    failed = [check.name for check in results if check.error]
    if failed:
        print(f"\ndoes not resolve: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
