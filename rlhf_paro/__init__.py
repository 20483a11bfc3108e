"""rlhf_paro: RLHF PPO on Ray with a PaRO sharding strategy per model."""

__version__ = "0.1.0"
