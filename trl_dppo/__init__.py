"""DPPO (Divergence Proximal Policy Optimization) for Hugging Face TRL."""

from .config import DPPOConfig
from .divergence import binary_divergence, topk_divergence, trust_region_mask
from .losses import dppo_gradient_weights, dppo_per_token_loss, loss_from_weights
from .trainer import DPPOTrainer


__version__ = "0.1.0"

__all__ = [
    "DPPOConfig",
    "DPPOTrainer",
    "binary_divergence",
    "topk_divergence",
    "trust_region_mask",
    "dppo_gradient_weights",
    "dppo_per_token_loss",
    "loss_from_weights",
]
