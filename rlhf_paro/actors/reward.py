"""The reward model: frozen, one score per sequence, trained beforehand on preference pairs."""

from __future__ import annotations

import torch

from rlhf_paro.actors.worker import Batch, Worker


class RewardWorker(Worker):
    """``reward`` comes to the workers already pointing at the trained model (``train.py``)."""

    @torch.no_grad()
    def score(self, rollout: Batch) -> torch.Tensor:
        """(B,) reward-model score of each sequence of this rank's rollout."""
        with self.timed("inference", rollout["sequences"].numel()):
            return self.in_micro_batches(rollout, self.forward)
