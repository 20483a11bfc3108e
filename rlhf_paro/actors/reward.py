"""The reward: a frozen model with one score per sequence, or, with no model, a Python function
or a reward server.

A reward model is a Hugging Face sequence classifier with one label (or the task's, trained
beforehand on preference pairs). With ``env.reward`` an environment's episode scores, which the
rollout carries, are the reward. When its tokenizer differs from the actor's, each rollout is
decoded with the actor's tokenizer and encoded again with the reward model's. A reward function
(``reward.function``, ``ppo/rewards.py``) gets the decoded prompts and responses and the other
columns of the prompts' rows, and a reward server (``reward.url``) gets them as JSON; then no
model is built and no process group joined.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from rlhf_paro import usercode
from rlhf_paro.actors.worker import Worker, peak_bytes
from rlhf_paro.config import ConfigError
from rlhf_paro.metrics import INFERENCE, RankReport, Sums
from rlhf_paro.ppo import data, rewards
from rlhf_paro.ppo.task import task_from_config
from rlhf_paro.rollout import RolloutBatch


class RewardWorker(Worker):
    """Scores rollouts with the reward model of ``reward.path``, the function of
    ``reward.function`` or the server at ``reward.url``."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        files = self.cfg.data.train_files is not None
        self.tokenizer = data.actor_tokenizer(self.cfg) if files else None
        spec = self.model_cfg.function
        self.function = usercode.load_function(spec) if spec else None
        self.url = self.model_cfg.url
        # Read here, on the worker's node, so that the token never travels in the config.
        self.token = _token(self.model_cfg.token_env) if self.url else None
        self.has_model = self.model_cfg.runs_model
        score_spec = self.model_cfg.score_function
        self.score_function = (usercode.load_function(score_spec, "reward.score_function")
                               if score_spec else None)
        # The reward model's own tokenizer, when it differs from the actor's.
        self.reward_tokenizer = (data.reward_tokenizer(self.cfg, self.tokenizer)
                                 if files and self.has_model else None)
        if self.reward_tokenizer is not None:
            self.reward_tokenizer.padding_side = "right"
        # Without prompt files the task's prompts are scored by its own rule, here: the one
        # source of ppo/task_score, as reward.score_function's score is with files.
        self.task = None if files else task_from_config(self.cfg)

    def serve_rendezvous(self) -> tuple[str, int]:
        """A reward model's rendezvous (``Worker.serve_rendezvous``); a function or server has
        none to serve (port 0: its ranks join no process group)."""
        if self.has_model:
            return super().serve_rendezvous()
        return self.node(), 0

    def setup(self, master_addr: str, master_port: int) -> int:
        """A reward model's setup (``Worker.setup``); a function or server joins no process
        group and builds nothing. Returns this worker's process id either way."""
        if self.has_model:
            return super().setup(master_addr, master_port)
        return os.getpid()

    @torch.no_grad()
    def score(self, step: int, rollout: RolloutBatch, rows: dict[str, Any] | None = None
              ) -> dict[str, Any]:
        """``scores``: (B,) reward of each sequence of this rank's rollout, and their
        ``reward_sums`` (``score_sums``). ``rows``: the prompts' texts and columns
        (``{"texts", "columns"}``), needed by a function or another tokenizer; None for the
        task's own prompts. A reward that runs no model gives its ``reward_report`` too, as of
        this scoring: a ``report`` call would queue behind a score of a rollout still
        generating (``ppo/step.py``)."""
        prompts = responses = None
        if rows is not None:
            prompts, responses = rows["texts"], self._responses(rollout)
        with self.timed(INFERENCE):
            if self.has_model:  # offload=params: parked again once its one phase is over
                batch = (rollout if self.reward_tokenizer is None
                         else self._encoded(prompts, responses))
                with self.on_device():
                    out, extras = self.in_micro_batches(batch, self.forward), {}
            else:
                # A function or server reads the real tokens, no padding.
                self.count_tokens(rollout.attention_mask, packed=True)
                if self.model_cfg.env_score:  # the episodes' scores (env.reward)
                    out, extras = rollout.scores.float(), {}
                else:
                    reward = self._modelless(step, prompts, responses, rows["columns"])
                    out, extras = torch.tensor(reward.scores), reward.extras
        sums = Sums()
        if rows is not None:
            score = out
            if self.score_function is not None:
                scored = rewards.call_function(self.score_function, self.model_cfg.score_function,
                                               step, prompts, responses, rows["columns"])
                score, extras = torch.tensor(scored.scores), {**extras, **scored.extras}
            sums = score_sums(score, extras)
        elif self.task is not None:
            sums = score_sums(self.task.score(rollout.prompts, rollout.responses,
                                              rollout.action_mask), {})
        given = {"scores": out, "reward_sums": sums}
        if not self.has_model:
            given["reward_report"] = self.report()
        return given

    def _modelless(self, step: int, prompts: list[str], responses: list[str],
                   columns: dict[str, list[Any]]) -> rewards.RewardOutput:
        """The reward of ``reward.function`` or of the server at ``reward.url``."""
        if self.function is not None:
            return rewards.call_function(self.function, self.model_cfg.function, step, prompts,
                                         responses, columns)
        return rewards.call_server(self.url, step, prompts, responses, columns,
                                   self.model_cfg.timeout_s, self.token)

    def _responses(self, rollout: RolloutBatch) -> list[str]:
        # The whole response: a multi-turn episode's observations too (a trajectory's score).
        return [self.tokenizer.decode(row[keep], skip_special_tokens=True)
                for row, keep in zip(rollout.responses, rollout.response_attention.bool())]

    def _encoded(self, prompts: list[str], responses: list[str]) -> RolloutBatch:
        """The rollout's text in the reward model's tokens, right-padded, ending in its eos."""
        tokenizer = self.reward_tokenizer
        eos = tokenizer.eos_token or ""
        enc = tokenizer([p + r + eos for p, r in zip(prompts, responses)], padding=True,
                        return_tensors="pt")
        mask = enc["attention_mask"]
        # The reward reads each row's last real token: the whole row stands as its response.
        return RolloutBatch(enc["input_ids"], mask, mask.float())

    def report(self) -> RankReport:
        if self.engine is not None:
            return super().report()
        report = RankReport(tokens=self._tokens, real_tokens=self._real_tokens,
                            time_s=dict(self._time_s), comm={}, memory={},
                            peak_bytes=peak_bytes(self.device))
        self._time_s.clear()
        self._tokens = self._real_tokens = 0
        return report


def _token(name: str | None) -> str | None:
    """The reward server's token from the variable ``reward.token_env`` names (None: no token),
    without the whitespace around it (``rewards.clean_token``)."""
    if name is None:
        return None
    token = os.environ.get(name)
    if not token:
        raise ConfigError("reward.token_env", f"the environment variable {name} is not set on the "
                                              "reward worker's node; allowed: set it where the "
                                              "workers run, as where the run starts")
    return rewards.clean_token(token, name, "reward.token_env")


def score_sums(score: torch.Tensor, extras: dict[str, list[float | None]]) -> Sums:
    """The sums of one rank's scores, for the driver to add up over the ranks and divide:

    - ``count``: its sequences; ``task_score``: the sum of their scores
      (``reward.score_function``'s, else the reward; without prompt files, the task's);
    - for each extra ``<name>`` that the reward function or server (or the score function) gave
      for at least one of them (a name both give: the score function's): ``reward/<name>``, its
      sum over the sequences that have it, and in ``counts`` how many have it. Its mean, logged
      as ``reward/<name>``, is the first over the second, each summed over the ranks. Ranks
      score different sequences, so a rank may lack a name that another has: it counts 0
      there.
    """
    sums = Sums(total={"count": float(len(score)), "task_score": float(score.sum())})
    for name, values in extras.items():
        present = [v for v in values if v is not None]
        sums.total[f"reward/{name}"] = math.fsum(present)
        sums.counts[f"reward/{name}"] = float(len(present))
    return sums
