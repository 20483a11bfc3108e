"""The policy: generates rollouts, turns them into advantages, trains on them.

What a rank generates stays on that rank: its rollout, old log-probs and advantages live here
between calls, and only what another model needs leaves (the rollout to the three models
colocated with this rank, the returns to the critic, a few sums to the driver).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from rlhf_paro.actors.worker import Batch, TrainedWorker, Worker
from rlhf_paro.ppo import core
from rlhf_paro.ppo.data import actor_tokenizer, tokenizer_dir
from rlhf_paro.ppo.task import join, response_mask, task_from_config


class ActorWorker(TrainedWorker):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.task = task_from_config(self.cfg)  # the task's prompts and score (no data files)
        # The actor's tokenizer (pad and eos ids); the task's when the actor is an inline config.
        self.tokenizer = (actor_tokenizer(self.cfg) if tokenizer_dir(self.cfg) is not None
                          else self.task.tokenizer)

    @torch.no_grad()
    def generate(self, prompts: torch.Tensor | Batch, greedy: bool = False
                 ) -> tuple[Batch, dict[str, float]]:
        """Sample one response per prompt, the full parameters gathered once for all of it.

        ``prompts``: the task's (B, P) ids, or ``{"input_ids", "attention_mask"}`` left-padded
        (``ppo/data.py``). ``greedy``: an evaluation, whose rollout is returned and not kept.
        Returns the rollout (for the other models of this rank) and sums for the driver.
        """
        ppo, tokenizer = self.cfg.ppo, self.tokenizer
        if isinstance(prompts, dict):
            prompts, prompt_mask = prompts["input_ids"], prompts["attention_mask"]
        else:
            prompt_mask = torch.ones_like(prompts)
        num_tokens = prompts.shape[0] * (prompts.shape[1] + ppo.max_new_tokens)
        sampling = ({"do_sample": False} if greedy else
                    {"do_sample": True, "temperature": ppo.temperature, "top_k": ppo.top_k})
        with self.timed("generate", num_tokens), self.engine.gathered(phase="generate") as model:
            model.eval()
            out = model.generate(prompts.to(self.device), prompt_mask.to(self.device),
                                 max_new_tokens=ppo.max_new_tokens,
                                 pad_token_id=tokenizer.pad_token_id,
                                 eos_token_id=tokenizer.eos_token_id, **sampling)
        responses = out[:, prompts.shape[1]:].cpu()
        # Generation stops when every row has ended: pad to a fixed response length.
        responses = F.pad(responses, (0, ppo.max_new_tokens - responses.shape[1]),
                          value=tokenizer.pad_token_id)
        action_mask = response_mask(responses, tokenizer.eos_token_id)
        sequences, attention_mask = join(prompts, responses, action_mask, prompt_mask)
        rollout = {"sequences": sequences, "attention_mask": attention_mask,
                   "action_mask": action_mask}
        stats = {"count": float(len(prompts)), "response_length": float(action_mask.sum())}
        if self.cfg.data.train_files is None:
            score = self.task.score(prompts, responses, action_mask)
            stats["task_score"] = float(score.sum())
        if not greedy:
            self._rollout = rollout
        return rollout, stats

    @torch.no_grad()
    def old_logprobs(self) -> None:
        """Log-probs of this rank's rollout under the policy that sampled it (kept here)."""
        rollout = self._rollout
        with self.timed("inference", rollout["sequences"].numel()):
            self._old_logp = self.in_micro_batches(rollout, lambda rows: logprobs(self, rows))

    @torch.no_grad()
    def make_experience(self, ref_logp: torch.Tensor, values: torch.Tensor, score: torch.Tensor,
                        kl_coef: float) -> tuple[Batch, dict[str, float]]:
        """KL-shaped token rewards, GAE and advantages whitened over the whole rollout batch.

        Returns the critic's targets and this rank's sums for the driver's means.
        """
        ppo = self.cfg.ppo
        mask = self._rollout["action_mask"]
        kl = core.kl_estimate(self._old_logp, ref_logp, ppo.kl_estimator) * mask
        rewards = core.token_rewards(score, kl, mask, kl_coef)
        advantages, returns = core.gae(rewards, values, mask, ppo.gamma, ppo.lam)
        self._advantages = advantages
        if ppo.whiten_advantages:
            # Moments summed over ranks: the same result as whitening the unsplit batch.
            moments = self.all_reduce_sum(core.masked_moments(advantages, mask))
            self._advantages = core.masked_whiten(advantages, mask, moments)
        stats = {"count": float(mask.shape[0]), "tokens": float(mask.sum()),
                 "reward": float(score.sum()), "kl": float(kl.sum()),
                 "advantage": float((advantages * mask).sum()),
                 "return": float((returns * mask).sum())}
        return {"returns": returns}, stats

    def train(self, step: int) -> None:
        """The PPO update of PPO step ``step`` on this rank's rollout."""
        rollout, ppo = self._rollout, self.cfg.ppo

        def micro_loss(idx: torch.Tensor, num_tokens: float) -> tuple[torch.Tensor, dict]:
            rows = {k: v[idx] for k, v in rollout.items()}
            loss, stats = core.policy_loss(
                logprobs(self, rows, train=True), self._old_logp[idx].to(self.device),
                self._advantages[idx].to(self.device), rows["action_mask"].to(self.device),
                ppo.clip_eps, num_tokens)
            return loss, {"actor/clipfrac": stats["clipfrac"], "approx_kl": stats["approx_kl"]}

        self.ppo_update(rollout["action_mask"], micro_loss, step)


def logprobs(worker: Worker, rows: Batch, train: bool = False) -> torch.Tensor:
    """(B, T) log-probs of the response tokens of ``rows`` under ``worker``'s causal LM, at the
    sampling temperature (so the rollout's log-probs are those of the policy that sampled it)."""
    return worker.forward(rows, train=train, response_len=rows["action_mask"].shape[1],
                          temperature=worker.cfg.ppo.temperature)
