"""The PPO loop, driven from one process; the four models run as Ray actor groups.

One step (every remote call goes to all N ranks of a model at once, each with its own slice):

    prompts --slice--> actor.generate                      (P gathered once: phase "generate")
    rollout[r] -> actor.old_logprobs | ref.logprobs | critic.values | reward.score  (concurrent)
    actor.make_experience: KL penalty, token rewards, GAE, advantages whitened over all ranks
    actor.train | critic.train: PPO epochs, mini-batches of s micro-batches    (concurrent)
    KL controller update; per-model reports -> one metrics row

A rank's rollout goes from its actor straight to the ref, critic and reward ranks on the same
device; the driver only sees object references and a few sums.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import ray

from rlhf_paro import report, runs
from rlhf_paro.actors.actor import ActorWorker
from rlhf_paro.actors.critic import CriticWorker
from rlhf_paro.actors.group import ModelGroup, init_ray, make_placement_group, missing_devices
from rlhf_paro.actors.ref import RefWorker
from rlhf_paro.actors.reward import RewardWorker
from rlhf_paro.config import ROLES, Config, ConfigError
from rlhf_paro.metrics import MetricsLogger, model_metrics
from rlhf_paro.ppo import core
from rlhf_paro.ppo.reward_model import reward_model_config
from rlhf_paro.ppo.task import task_from_config

WORKERS = {"actor": ActorWorker, "critic": CriticWorker, "reward": RewardWorker,
           "ref": RefWorker}


class PPOTrainer:
    """Places the four models on the devices and runs PPO steps."""

    def __init__(self, cfg: Config) -> None:
        num_devices, use_gpu = cfg.cluster.num_devices, cfg.cluster.device == "cuda"
        init_ray(cfg.ray.address, cfg.ray.num_cpus, num_devices)
        problem = missing_devices(num_devices, use_gpu)
        if problem:
            raise ConfigError("cluster.num_devices", problem)
        # The reward model is trained here on first use (cached after), once, not by N ranks.
        cfg = dataclasses.replace(cfg, reward=reward_model_config(cfg))
        self.cfg = cfg
        pg, bundles = make_placement_group(num_devices, use_gpu)
        self.models = {role: ModelGroup(WORKERS[role], role, cfg, pg, bundles, use_gpu)
                       for role in ROLES}
        # The four models join their process groups and build their engines at once.
        ray.get([ref for group in self.models.values() for ref in group.rendezvous()])
        self.task = task_from_config(cfg)
        self.prompts = runs.Prompts(cfg, self.task)  # from data.train_files, or the task's
        self.num_steps_done = 0  # names the step in a reward function's error
        ppo = cfg.ppo
        self.kl_ctl = core.kl_controller(ppo.kl_coef, ppo.adaptive_kl, ppo.kl_target,
                                         ppo.kl_horizon)

    def fit(self) -> str:
        """Run ``trainer.steps`` steps, logging each; returns the dashboard's path."""
        cfg = self.cfg
        wandb_cfg = cfg.logger.wandb
        logger = MetricsLogger(cfg.trainer.output_dir, cfg.trainer.steps, run_info(cfg),
                               wandb_mode=wandb_cfg.mode, show_progress=cfg.logger.progress,
                               wandb_init={"project": wandb_cfg.project, "name": wandb_cfg.name,
                                           "entity": wandb_cfg.entity, "tags": wandb_cfg.tags})
        try:
            for step in range(cfg.trainer.steps):
                row = self.step()
                done = step + 1
                if cfg.trainer.eval_every and self.prompts.val is not None and \
                        (done % cfg.trainer.eval_every == 0 or done == cfg.trainer.steps):
                    row.update(runs.evaluate(self.models, self.prompts, done))
                if cfg.trainer.export_every and done % cfg.trainer.export_every == 0:
                    runs.export(self.models, cfg.trainer.output_dir, done)
                logger.log(step, row)
            runs.export(self.models, cfg.trainer.output_dir)
        finally:
            logger.close()
        return report.draw(cfg.trainer.output_dir)

    def step(self) -> dict[str, float]:
        actor, critic, ref, reward = (self.models[r] for r in ("actor", "critic", "ref", "reward"))
        start = time.perf_counter()

        # Sliced here, before anything is sent: each rank receives only its own prompts.
        prompts, rows = self.prompts.next(self.cfg.ppo.rollout_batch_size)
        rollouts, gen_stats = zip(*actor.call("generate", prompts, num_returns=2))
        self.num_steps_done += 1
        gen = _sum(ray.get(list(gen_stats)))
        generated = time.perf_counter()

        old = actor.call("old_logprobs")
        ref_logp = ref.call("logprobs", rollouts)
        values = critic.call("values", rollouts)
        scores = (reward.call("score", rollouts) if rows is None else
                  reward.call("score", rollouts, rows, step=self.num_steps_done))
        targets, exp_stats = zip(*actor.call("make_experience", ref_logp, values, scores,
                                             kl_coef=self.kl_ctl.value, num_returns=2))
        exp = _sum(ray.get(list(exp_stats)))
        if rows is not None:
            gen.update(_sum(ray.get(reward.call("score_sums"))))
        ray.get(old)
        experienced = time.perf_counter()

        ray.get(actor.call("train") + critic.call("train", list(targets)))
        trained = time.perf_counter()

        pending = {role: group.call("report") for role, group in self.models.items()}
        row: dict[str, float] = {}
        for role, refs in pending.items():
            row.update(model_metrics(role, ray.get(refs)))

        kl = exp["kl"] / exp["count"]  # per sequence, summed over its tokens
        kl_coef = self.kl_ctl.value
        self.kl_ctl.update(kl, int(exp["count"]))
        done = time.perf_counter()
        row.update({
            "ppo/reward_mean": exp["reward"] / exp["count"],
            "ppo/task_score": gen["task_score"] / gen["count"],
            "ppo/kl": kl,
            "ppo/kl_coef": kl_coef,
            "ppo/advantage_mean": exp["advantage"] / exp["tokens"],
            "ppo/return_mean": exp["return"] / exp["tokens"],
            "ppo/response_length": gen["response_length"] / gen["count"],
            "timing_s/generate": generated - start,
            "timing_s/make_experience": experienced - generated,
            "timing_s/train": trained - experienced,
            "timing_s/step": done - start,
            "perf/samples_per_s": gen["count"] / (done - start),
        })
        return row

    def shutdown(self) -> None:
        for group in self.models.values():
            group.shutdown()


def run_info(cfg: Config) -> dict[str, Any]:
    """What the dashboard's title and the wandb run's config say about the run."""
    return {
        "name": cfg.logger.wandb.name or cfg.trainer.output_dir.rstrip("/").split("/")[-1],
        "num_devices": cfg.cluster.num_devices,
        "group_size": cfg.cluster.group_size,
        "comm": cfg.comm.algorithm,
        "strategies": {role: cfg.model(role).strategy for role in ROLES},
        "config": cfg.to_dict(),
    }


def _sum(dicts: list[dict[str, float]]) -> dict[str, float]:
    return {k: sum(d[k] for d in dicts) for k in dicts[0]}
