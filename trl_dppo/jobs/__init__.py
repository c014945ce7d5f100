"""The jobs this package ships (`trl-dppo COMMAND`, see `cli`), their data, rewards, offline default model and plots.

Not needed to use DPPOTrainer in your own script: `from trl_dppo import DPPOConfig, DPPOTrainer` is the algorithm.
"""
