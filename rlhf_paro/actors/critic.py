"""The critic: values of the rollout's response tokens, then clipped value regression."""

from __future__ import annotations

import torch

from typing import Any

from rlhf_paro.actors.worker import TrainedWorker
from rlhf_paro.metrics import INFERENCE
from rlhf_paro.ppo import core
from rlhf_paro.rollout import RolloutBatch


class CriticWorker(TrainedWorker):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._old_values: torch.Tensor | None = None  # this step's, from values

    @torch.no_grad()
    def values(self, rollout: RolloutBatch) -> torch.Tensor:
        """(B, T) values of this rank's rollout, kept here as the old values of the update."""
        self._rollout = rollout
        # offload=params: back on the device from here to the end of train(); parked while the
        # actor generates.
        self.unpark()
        with self.timed(INFERENCE):
            self._old_values = self.in_micro_batches(rollout, self._values)
        return self._old_values

    def _values(self, rows: RolloutBatch, train: bool = False) -> torch.Tensor:
        return self.forward(rows, train=train, response_len=rows.response_len)

    def train(self, returns: torch.Tensor, step: int) -> None:
        """The value update of PPO step ``step`` towards this rank's (B, T) returns."""
        rollout = self._rollout

        def micro_loss(idx: torch.Tensor, num_tokens: float) -> tuple[torch.Tensor, dict]:
            rows = rollout.select(idx)
            loss, stats = core.value_loss(
                self._values(rows, train=True), self._old_values[idx].to(self.device),
                returns[idx].to(self.device), rows.action_mask.to(self.device),
                self.cfg.ppo.value_clip_eps, num_tokens)
            return loss, {"critic/vf_clipfrac": stats["vf_clipfrac"]}

        self.ppo_update(rollout.action_mask, micro_loss, step)
        self.park()
