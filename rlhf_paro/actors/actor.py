"""The policy: generates rollouts, turns them into advantages, trains on them.

What a rank generates stays on that rank: its rollout, old log-probs and advantages live here
between calls, and only what another model needs leaves (the rollout to the three models
colocated with this rank, the returns to the critic, a few sums to the driver).
"""

from __future__ import annotations

from typing import Any

import torch

from rlhf_paro.actors.worker import Batch, TrainedWorker, Worker
from rlhf_paro.comm.meter import GENERATE
from rlhf_paro.metrics import INFERENCE
from rlhf_paro.ppo import algorithms, core
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
        sampling = ({"do_sample": False} if greedy else
                    {"do_sample": True, "temperature": ppo.temperature, "top_k": ppo.top_k})
        with self.timed(GENERATE), self.engine.gathered(phase=GENERATE) as model:
            model.eval()
            out = model.generate(prompts.to(self.device), prompt_mask.to(self.device),
                                 max_new_tokens=ppo.max_new_tokens,
                                 pad_token_id=tokenizer.pad_token_id,
                                 eos_token_id=tokenizer.eos_token_id, **sampling)
        # Generation stops when every row has ended: the rank's responses are as wide as its
        # longest, never padded out to ppo.max_new_tokens (every model computes on this width
        # where it runs padded).
        responses = out[:, prompts.shape[1]:].cpu()
        action_mask = response_mask(responses, tokenizer.eos_token_id)
        sequences, attention_mask = join(prompts, responses, action_mask, prompt_mask)
        rollout = {"sequences": sequences, "attention_mask": attention_mask,
                   "action_mask": action_mask}
        # Generation runs padded (a key/value cache per row): every position of the rows.
        self.count_tokens(attention_mask, packed=False)
        stats = {"count": float(len(prompts)), "response_length": float(action_mask.sum()),
                 "real_tokens": float(attention_mask.sum())}
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
        with self.timed(INFERENCE):
            self._old_logp = self.in_micro_batches(rollout, lambda rows: logprobs(self, rows))

    @torch.no_grad()
    def make_experience(self, ref_logp: torch.Tensor | None, values: torch.Tensor | None,
                        score: torch.Tensor, kl_coef: float) -> tuple[Batch, dict[str, float]]:
        """Token rewards (the KL penalty in them unless ``algorithm.kl_in_loss``), then the
        advantages of the run's estimator (``ppo/algorithms.py``, ``core.advantages``).

        ``ref_logp``: None in a run without a reference; ``values``: None without a critic.
        A rank's rollout holds whole groups of ``rollout.n`` samples (``runs.Prompts.next``), so
        group baselines need nothing from other ranks; batch-wide normalisations sum their
        moments over ranks. Returns the critic's targets and this rank's sums for the driver.
        """
        ppo, alg = self.cfg.ppo, self.cfg.algorithm
        mask = self._rollout["action_mask"]
        kl = torch.zeros_like(mask, dtype=torch.float32)
        if ref_logp is not None:
            kl = core.kl_estimate(self._old_logp, ref_logp, alg.kl_estimator) * mask
        self._ref_logp = ref_logp if alg.kl_in_loss else None
        rewards = core.token_rewards(score, kl, mask, 0.0 if alg.kl_in_loss else kl_coef)
        groups = torch.arange(len(mask)).div(self.cfg.rollout.n, rounding_mode="floor")
        self._advantages, returns = core.advantages(alg.adv_estimator, core.AdvantageInputs(
            rewards=rewards, mask=mask, group=groups, values=values, gamma=ppo.gamma,
            lam=ppo.lam, whiten=ppo.whiten_advantages, sum_over_ranks=self.all_reduce_sum))
        stats = {"count": float(mask.shape[0]), "tokens": float(mask.sum()),
                 "reward": float(score.sum()), "kl": float(kl.sum()),
                 "advantage": float((self._advantages * mask).sum()),
                 "return": float((returns * mask).sum())}
        return {"returns": returns}, stats

    def train(self, step: int, kl_coef: float) -> None:
        """The policy update of step ``step`` on this rank's rollout: the clipped surrogate,
        aggregated as the algorithm says, plus ``kl_coef`` times the KL loss term when
        ``algorithm.kl_in_loss``."""
        rollout, ppo, alg = self._rollout, self.cfg.ppo, self.cfg.algorithm
        agg = algorithms.loss_agg_mode(self.cfg)
        # Dr. GRPO divides each sequence's token sum by the response budget, a constant.
        norm = (ppo.max_new_tokens if algorithms.spec(self.cfg).token_sum_norm
                and agg == "seq_mean_token_sum" else None)

        def micro_loss(idx: torch.Tensor, divisor: float) -> tuple[torch.Tensor, dict]:
            rows = {k: v[idx] for k, v in rollout.items()}
            mask = rows["action_mask"].to(self.device)
            logp = logprobs(self, rows, train=True)
            loss, stats = core.policy_loss(
                logp, self._old_logp[idx].to(self.device),
                self._advantages[idx].to(self.device), mask, ppo.clip_eps, divisor, agg=agg,
                token_sum_norm=norm)
            metrics = {"actor/clipfrac": stats["clipfrac"], "approx_kl": stats["approx_kl"]}
            if self._ref_logp is not None:
                kl_loss, kl_stats = core.kl_loss(logp, self._ref_logp[idx].to(self.device), mask,
                                                 alg.kl_estimator, agg, divisor, norm)
                loss = loss + kl_coef * kl_loss
                metrics["actor/kl_loss"] = kl_stats["kl"]
            return loss, metrics

        self.ppo_update(rollout["action_mask"], micro_loss, step, agg)


def logprobs(worker: Worker, rows: Batch, train: bool = False) -> torch.Tensor:
    """(B, T) log-probs of the response tokens of ``rows`` under ``worker``'s causal LM, at the
    sampling temperature (so the rollout's log-probs are those of the policy that sampled it)."""
    return worker.forward(rows, train=train, response_len=rows["action_mask"].shape[1],
                          temperature=worker.cfg.ppo.temperature)
