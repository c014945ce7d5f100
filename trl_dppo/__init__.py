"""DPPO (Divergence Proximal Policy Optimization) for Hugging Face TRL."""

import importlib
from typing import TYPE_CHECKING


if TYPE_CHECKING:
    from .async_config import AsyncDPPOConfig
    from .async_trainer import AsyncDPPOTrainer
    from .config import DPPOConfig
    from .divergence import binary_divergence, topk_divergence, trust_region_mask
    from .losses import dppo_gradient_weights, dppo_per_token_loss, loss_from_weights
    from .trainer import DPPOTrainer


__version__ = "0.1.0"

__all__ = [
    "AsyncDPPOConfig",
    "AsyncDPPOTrainer",
    "DPPOConfig",
    "DPPOTrainer",
    "binary_divergence",
    "topk_divergence",
    "trust_region_mask",
    "dppo_gradient_weights",
    "dppo_per_token_loss",
    "loss_from_weights",
]

# Where each public name lives. They are imported on first access, so that importing the package (for `__version__`,
# or `trl_dppo.jobs.plots` to draw a run's log) loads neither torch nor TRL.
_MODULES = {
    "AsyncDPPOConfig": ".async_config",
    "AsyncDPPOTrainer": ".async_trainer",
    "DPPOConfig": ".config",
    "DPPOTrainer": ".trainer",
    "binary_divergence": ".divergence",
    "topk_divergence": ".divergence",
    "trust_region_mask": ".divergence",
    "dppo_gradient_weights": ".losses",
    "dppo_per_token_loss": ".losses",
    "loss_from_weights": ".losses",
}


def __getattr__(name: str):
    if name not in _MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_MODULES[name], __name__), name)
    globals()[name] = value  # later accesses find it without coming here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
