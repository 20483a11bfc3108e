"""The reference policy: the actor's initial weights, frozen; scores rollouts for the KL penalty."""

from __future__ import annotations

import torch

from rlhf_paro.actors.actor import logprobs
from rlhf_paro.actors.worker import Worker
from rlhf_paro.metrics import INFERENCE
from rlhf_paro.rollout import RolloutBatch


class RefWorker(Worker):
    """Built like the actor, from the same seed: it starts as the actor's exact copy."""

    @torch.no_grad()
    def logprobs(self, step: int, rollout: RolloutBatch) -> dict[str, torch.Tensor]:
        """``ref_logp``: (B, T) log-probs of this rank's rollout under the reference policy."""
        # offload=params: parked again once its one phase of the step is over.
        with self.timed(INFERENCE), self.on_device():
            return {"ref_logp": self.in_micro_batches(rollout, lambda rows: logprobs(self, rows))}
