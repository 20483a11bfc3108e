"""Resolve, the config's third part (docs/design.md, "Configuration"): what a composed ``Config``
needs before anything runs or is planned, done once by the entry points (``train``, ``plan``).

``resolve(cfg)`` returns the config to run, in this order:

1. the demo's assets that ``${demo:NAME}`` still names are made (``ppo/demo.py``; once, then
   cached): composing a conf only names them;
2. every file the config names is checked: model and tokenizer directories, reward function
   files, prompt files, the checkpoint to resume from, a reward server's token variable;
3. the algorithm's rules are checked (``ppo/algorithms.check``), and the rollout engine's name
   against the engines registered and the run against the engine's own check
   (``rlhf_paro/rollout``: vLLM installed, the architecture served);
4. the values that come from other sections are set: reward and ref with no source take the
   actor's (a copy of its inline config), the critic of an algorithm that trains one takes the
   reward model's directory (its score head starts the value head) or else the actor's, and the
   actor's instead when the reward model has a tokenizer of its own (said in one line); a
   DeepSpeed model's ``strategy`` is the PaRO strategy its stage stands for.

The input is left as it is; resolving a resolved config returns an equal one.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from pathlib import Path
from typing import Callable

from rlhf_paro.config import FROZEN_ROLES, MANIFEST, RESUME_CHOICES, ROLES, Config, ConfigError, \
    data_files
from rlhf_paro import rollout
from rlhf_paro.ppo import algorithms, demo, rewards


def resolve(cfg: Config, say: Callable[[str], None] = print, engine_check: bool = True
            ) -> Config:
    """The config to run (see the module docstring); ``ConfigError`` for a user's mistake.
    ``say`` prints the one line of a decision the user did not write (the critic's source).
    ``engine_check=False`` checks the rollout engine's name only, not the engine's own check of
    the machine it runs on (the planner's: it builds no engine, and plans a cluster from a
    machine that may not have the engine installed)."""
    cfg = demo.make_assets(cfg)
    check_files(cfg)
    algorithms.check(cfg)
    rollout.check(cfg, engine=engine_check)
    return derive(cfg, say)


def check_files(cfg: Config) -> None:
    """``ConfigError`` naming the key of the first file or directory the config names that is not
    there (nothing is downloaded: a path is always local)."""
    for role in ROLES:
        model = cfg.model(role)
        for key in ("function", "score_function"):
            if getattr(model, key) is not None:
                rewards.function_file(getattr(model, key), f"{role}.{key}")
        # Checked when the run starts, not at the first step: a missing token would stop it there.
        if model.url is not None and model.token_env is not None and \
                not os.environ.get(model.token_env):
            raise ConfigError(f"{role}.token_env", f"the environment variable {model.token_env} "
                                                   "is not set (or empty); allowed: the name of "
                                                   "a variable holding the reward server's token")
        if model.tokenizer is not None and not Path(model.tokenizer).expanduser().is_dir():
            raise ConfigError(f"{role}.tokenizer", f"no directory at {model.tokenizer!r}; "
                                                   "allowed: a local tokenizer directory, never "
                                                   "downloaded")
        if model.path is not None and not (Path(model.path).expanduser() / "config.json").is_file():
            raise ConfigError(f"{role}.path", f"no Hugging Face model directory at "
                                              f"{model.path!r} (needs config.json); allowed: an "
                                              "existing local directory, models are never "
                                              "downloaded")
    if cfg.env.function is not None:
        rewards.function_file(cfg.env.function, "env.function")
    if cfg.env.tools is not None and not Path(cfg.env.tools.rpartition(":")[0]).expanduser() \
            .is_file():
        raise ConfigError("env.tools", f"no file {cfg.env.tools.rpartition(':')[0]!r}; "
                                       "allowed: an existing .py file")
    resume = cfg.trainer.resume
    if resume not in RESUME_CHOICES and not (Path(resume).expanduser() / MANIFEST).is_file():
        raise ConfigError("trainer.resume", f"no complete checkpoint at {resume!r} (it has no "
                                            f"{MANIFEST}); allowed: auto, none or a checkpoint "
                                            "directory such as OUTPUT_DIR/checkpoints/step_10")
    for key in ("train_files", "val_files"):
        for file in data_files(getattr(cfg.data, key)):
            if not file.endswith((".json", ".jsonl", ".parquet")):
                raise ConfigError(f"data.{key}", f"{file!r} is not a data file; allowed: local "
                                                 ".json, .jsonl or .parquet files")
            if not Path(file).expanduser().is_file():
                raise ConfigError(f"data.{key}", f"no file {file!r}; allowed: existing local "
                                                 "files")


def derive(cfg: Config, say: Callable[[str], None] = print) -> Config:
    """``cfg`` with the values that come from other sections set (step 4 of the module
    docstring); reads the reward model's tokenizer when the critic would start from it."""
    if cfg.env.enabled:
        cfg = _with_env(cfg)
    actor = cfg.actor
    changed = {}
    for role in ("reward", "ref"):
        model = cfg.model(role)
        if model.path is None and model.config is None and model.runs_model:
            changed[role] = dataclasses.replace(model, path=actor.path,
                                                config=copy.deepcopy(actor.config))
    cfg = dataclasses.replace(cfg, **changed)
    if "critic" in algorithms.roles(cfg):
        cfg = _with_critic_source(cfg, say)
    deepspeed = {role: dataclasses.replace(cfg.model(role), strategy=cfg.model(role).deepspeed
                                           .strategy(role in FROZEN_ROLES,
                                                     cfg.cluster.group_size))
                 for role in ROLES if cfg.model(role).backend == "deepspeed"}
    return dataclasses.replace(cfg, **deepspeed)


def _with_critic_source(cfg: Config, say: Callable[[str], None]) -> Config:
    from rlhf_paro.ppo.data import reward_tokenizer

    critic, actor_source = cfg.critic, (cfg.actor.path, copy.deepcopy(cfg.actor.config))
    if critic.path is None and critic.config is None:
        # A reward model's score head starts the value head (as OpenRLHF does), else the actor.
        path, config = (cfg.reward.path, None) if cfg.reward.path is not None else actor_source
        critic = dataclasses.replace(critic, path=path, config=config)
    # A critic reads the actor's tokens: not one started from a reward model of another tokenizer.
    if critic.path is not None and critic.path == cfg.reward.path and \
            reward_tokenizer(cfg) is not None:
        say(f"critic: starts from the actor ({cfg.actor.path or 'its inline config'}), not from "
            "the reward model, whose tokenizer differs from the actor's")
        path, config = actor_source
        critic = dataclasses.replace(critic, path=path, config=config)
    return dataclasses.replace(cfg, critic=critic)


def _with_env(cfg: Config) -> Config:
    """An environment's run: the episode's score from the environment when ``env.reward`` says
    so (the reward section's source then unused), the episode budget of the actor's positions
    when ``env.max_total_tokens`` is null, and the environment checked against the first prompt
    row (``envs.check_factory``: its file, its class, ``NAME(**row)``)."""
    from rlhf_paro import envs, models
    from rlhf_paro.ppo import data

    env, reward = cfg.env, cfg.reward
    if cfg.env_scores:
        reward = dataclasses.replace(reward, path=None, config=None, function=None, url=None,
                                     env_score=True)
    if env.max_total_tokens is None:
        hf = models.hf_config("actor", cfg.actor, data.vocab_sizes(cfg)["actor"])
        env = dataclasses.replace(env, max_total_tokens=int(hf.max_position_embeddings))
    cfg = dataclasses.replace(cfg, reward=reward, env=env)
    if env.function is not None:
        envs.check_factory(cfg, data.first_row(cfg))
    else:
        envs.load(cfg)  # the tools and their schemas
    return cfg
