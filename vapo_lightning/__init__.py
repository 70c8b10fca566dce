"""vapo-lightning: VAPO (Value-based Augmented PPO, arXiv 2504.05118) on PyTorch Lightning."""

__version__ = "0.1.0"
