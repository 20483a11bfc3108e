"""The critic: values of the rollout's response tokens, then clipped value regression."""

from __future__ import annotations

import torch

from typing import Any

from rlhf_paro.actors.worker import TrainedWorker
from rlhf_paro.metrics import INFERENCE
from rlhf_paro.ppo import core
from rlhf_paro.rollout import RolloutBatch


class CriticWorker(TrainedWorker):
    @torch.no_grad()
    def values(self, step: int, rollout: RolloutBatch) -> dict[str, torch.Tensor]:
        """``values``: (B, T) values of this rank's rollout, the old values of the update."""
        # offload=params: back on the device from here to the end of train(); parked while the
        # actor generates.
        self.unpark()
        with self.timed(INFERENCE):
            return {"values": self.in_micro_batches(rollout, self._values)}

    def _values(self, rows: RolloutBatch, train: bool = False) -> torch.Tensor:
        return self.forward(rows, train=train, response_len=rows.response_len)

    def train(self, step: int, rollout: RolloutBatch, values: torch.Tensor,
              targets: torch.Tensor) -> dict[str, None]:
        """The value update of PPO step ``step`` from the old ``values`` towards this rank's
        (B, T) ``targets`` (the returns); gives ``trained`` when done."""

        def micro_loss(idx: torch.Tensor, num_tokens: float, ahead: Any
                       ) -> tuple[torch.Tensor, dict]:
            rows = rollout.select(idx)
            loss, stats = core.value_loss(
                self._values(rows, train=True), values[idx].to(self.device),
                targets[idx].to(self.device), rows.action_mask.to(self.device),
                self.cfg.ppo.value_clip_eps, num_tokens)
            return loss, {"critic/vf_clipfrac": stats["vf_clipfrac"]}

        self.ppo_update(rollout, micro_loss, step)
        self.park()
        return {"trained": None}
