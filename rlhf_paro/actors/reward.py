"""The reward: a frozen model with one score per sequence, or a Python function (no model).

A reward model is a Hugging Face sequence classifier with one label (or the task's, trained
beforehand on preference pairs). When its tokenizer differs from the actor's, each rollout is
decoded with the actor's tokenizer and encoded again with the reward model's. A reward function
(``reward.function``, ``ppo/rewards.py``) gets the decoded prompts and responses and the other
columns of the prompts' rows; no model is built and no process group joined.
"""

from __future__ import annotations

from typing import Any

import torch

from rlhf_paro.actors.worker import Batch, Worker, peak_bytes
from rlhf_paro.metrics import RankReport
from rlhf_paro.ppo import data, rewards


class RewardWorker(Worker):
    """Scores rollouts with the reward model of ``reward.path`` or the function of
    ``reward.function``."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        files = self.cfg.data.train_files is not None
        self.tokenizer = data.actor_tokenizer(self.cfg) if files else None
        spec = self.model_cfg.function
        self.function = rewards.load_function(spec) if spec else None
        score_spec = self.model_cfg.score_function
        self.score_function = (rewards.load_function(score_spec, "reward.score_function")
                               if score_spec else None)
        # The reward model's own tokenizer, when it differs from the actor's.
        self.reward_tokenizer = data.reward_tokenizer(self.cfg, self.tokenizer) if files else None
        if self.reward_tokenizer is not None:
            self.reward_tokenizer.padding_side = "right"
        self._score_sums = {"count": 0.0, "task_score": 0.0}

    def setup(self, master_addr: str, master_port: int) -> None:
        if self.function is None:
            super().setup(master_addr, master_port)

    @torch.no_grad()
    def score(self, rollout: Batch, rows: dict[str, Any] | None = None, step: int = 0
              ) -> torch.Tensor:
        """(B,) reward of each sequence of this rank's rollout. ``rows``: the prompts' texts and
        columns (``{"texts", "columns"}``), needed by a function or another tokenizer."""
        prompts = responses = None
        if rows is not None:
            prompts, responses = rows["texts"], self._responses(rollout)
        with self.timed("inference", rollout["sequences"].numel()):
            if self.function is not None:
                out = torch.tensor(rewards.call_function(
                    self.function, self.model_cfg.function, step, prompts, responses,
                    rows["columns"]))
            else:  # offload=params: parked again once its one phase of the step is over
                batch = (rollout if self.reward_tokenizer is None
                         else self._encoded(prompts, responses))
                with self.on_device():
                    out = self.in_micro_batches(batch, self.forward)
        if rows is not None:
            score = out if self.score_function is None else torch.tensor(rewards.call_function(
                self.score_function, self.model_cfg.score_function, step, prompts, responses,
                rows["columns"]))
            self._score_sums = {"count": float(len(score)), "task_score": float(score.sum())}
        return out

    def score_sums(self) -> dict[str, float]:
        """Count and sum of the score (``reward.score_function``, else the reward) of the last
        rollout scored."""
        return self._score_sums

    def _responses(self, rollout: Batch) -> list[str]:
        width = rollout["action_mask"].shape[1]
        tokens = rollout["sequences"][:, -width:]
        mask = rollout["action_mask"].bool()
        return [self.tokenizer.decode(row[keep], skip_special_tokens=True)
                for row, keep in zip(tokens, mask)]

    def _encoded(self, prompts: list[str], responses: list[str]) -> Batch:
        """The rollout's text in the reward model's tokens, right-padded, ending in its eos."""
        tokenizer = self.reward_tokenizer
        eos = tokenizer.eos_token or ""
        enc = tokenizer([p + r + eos for p, r in zip(prompts, responses)], padding=True,
                        return_tensors="pt")
        mask = enc["attention_mask"]
        return {"sequences": enc["input_ids"], "attention_mask": mask, "action_mask": mask}

    def report(self) -> RankReport:
        if self.engine is not None:
            return super().report()
        report = RankReport(tokens=self._tokens, time_s=dict(self._time_s), comm={}, memory={},
                            peak_bytes=peak_bytes(self.device))
        self._time_s.clear()
        self._tokens = 0
        return report
