"""Resolve, the config's third part (docs/design.md, "Configuration"): what a composed ``Config``
needs before anything runs or is planned, done once by the entry points (``train``, ``plan``).

``resolve(cfg)`` returns the config to run, in this order:

1. the demo's assets that ``${demo:NAME}`` still names are made (``ppo/demo.py``; once, then
   cached): composing a conf only names them;
2. every file the config names is checked: model and tokenizer directories, reward function
   files, prompt files, the checkpoint to resume from, a reward server's token variable;
3. the algorithm's rules are checked (``ppo/algorithms.check``), and the rollout engine's name
   against the engines registered;
4. the values that come from other sections are set: reward and ref with no source take the
   actor's (a copy of its inline config), the critic of an algorithm that trains one takes the
   reward model's directory (its score head starts the value head) or else the actor's, and the
   actor's instead when the reward model has a tokenizer of its own (said in one line); a
   DeepSpeed model's ``strategy`` is the PaRO strategy its stage stands for; a null
   ``algorithm.kl_estimator`` is the one for where the KL goes (``algorithms.kl_estimator``);
5. the run is checked against the models: the rollout engine's own check of the actor it would
   serve (``rlhf_paro/rollout``: vLLM installed, the architecture served), and the longest
   sequence a step may hold against each model's positions and the engine's own limit
   (``check_longest_sequence``).

The input is left as it is; resolving a resolved config returns an equal one.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from pathlib import Path
from typing import Callable

from rlhf_paro.config import FROZEN_ROLES, MANIFEST, RESUME_CHOICES, ROLES, Config, ConfigError, \
    data_files, map_paths
from rlhf_paro import models, rollout, usercode
from rlhf_paro.ppo import algorithms, demo, rewards

# The files a model directory saved by save_pretrained keeps its weights in, sharded or not.
WEIGHT_FILES = ("model*.safetensors", "pytorch_model*.bin")


def resolve(cfg: Config, say: Callable[[str], None] = print, engine_check: bool = True
            ) -> Config:
    """The config to run (see the module docstring); ``ConfigError`` for a user's mistake.
    ``say`` prints the one line of a decision the user did not write (the critic's source).
    ``engine_check=False`` checks the rollout engine's name only, not the engine's own check of
    the machine it runs on nor its own limit on a sequence (the planner's: it builds no engine,
    and plans a cluster from a machine that may not have the engine installed)."""
    from rlhf_paro.ppo.data import vocab_sizes

    cfg = demo.make_assets(cfg)
    check_files(cfg)
    cfg = absolute_paths(cfg)
    algorithms.check(cfg)
    rollout.check(cfg)
    cfg = derive(cfg, say)
    sizes = vocab_sizes(cfg)
    if engine_check:
        rollout.check(cfg, models.hf_config("actor", cfg.actor, sizes["actor"]))
    check_longest_sequence(cfg, *longest_sequence(cfg), sizes, engine=engine_check)
    return cfg


def longest_sequence(cfg: Config) -> tuple[int, str, str]:
    """(tokens, key, what) of the longest sequence a step of the resolved run may hold
    (``Config.longest_sequence``): the key an error names and what the tokens are, for its line.
    An episode's budget, ``env.max_total_tokens``, with an environment; else the prompt bound +
    ``ppo.max_new_tokens``."""
    what, longest = cfg.longest_sequence()
    if cfg.env.enabled:
        return longest, "env.max_total_tokens", "an episode's budget"
    return longest, "ppo.max_new_tokens", what


def context_limits(cfg: Config, vocab_sizes: dict[str, int], engine: bool = True
                   ) -> list[tuple[int, str]]:
    """(tokens, what) of every limit on the length of a sequence of the resolved run, shortest
    first: the positions of each model it builds (``models.max_positions``) and, with
    ``engine``, the rollout engine's own limit on the actor (``rollout.max_len``)."""
    from rlhf_paro.ppo.data import reward_tokenizer

    limits = []
    for role in algorithms.roles(cfg):
        model_cfg = cfg.model(role)
        if not model_cfg.runs_model:
            continue
        # A reward model of its own tokenizer reads the text encoded again: a length in its
        # tokens, not known before the text exists.
        if role == "reward" and reward_tokenizer(cfg) is not None:
            continue
        config = models.hf_config(role, model_cfg, vocab_sizes[role])
        positions = models.max_positions(config)
        if positions is not None:
            limits.append((positions, f"{role}'s max_position_embeddings"))
        if role == "actor" and engine:
            own = rollout.max_len(cfg.rollout.engine, config)
            if own is not None:
                limits.append(own)
    return sorted(limits, key=lambda limit: limit[0])


def check_longest_sequence(cfg: Config, longest: int, key: str, what: str,
                           vocab_sizes: dict[str, int], engine: bool = True) -> None:
    """``ConfigError`` naming ``key`` when a sequence of ``longest`` tokens, the longest a step of
    the resolved run may hold (``what``: what it is made of), exceeds a limit of
    ``context_limits``: a model would index positions it has not got (GPT-2 fails at its first
    forward), and vLLM would cut responses short without a word. ``longest_sequence`` gives the
    run's (a PPO step's, or an episode's budget); any other bound comes with its own key."""
    for tokens, limit in context_limits(cfg, vocab_sizes, engine):
        if longest <= tokens:
            continue
        value = cfg
        for part in key.split("."):
            value = getattr(value, part)
        lower = value - (longest - tokens)
        hint = f" ({key}={lower} here)" if lower > 0 else ""
        raise ConfigError(key, f"{longest} tokens ({what}) exceed {limit}={tokens}; allowed: "
                               f"at most {tokens} tokens in all{hint}, or a model with more "
                               "positions")


def absolute_paths(cfg: Config) -> Config:
    """``cfg`` with every local path it names (``config.PATH_KEYS``) absolute, a relative one
    taken from this process's working directory, where the user typed it. The workers do not
    run there: on a joined cluster they start in the raylet's directory, on other nodes in
    theirs, so a relative path would name another file or none (a run's checkpoints written
    under another folder, a model directory not found). A leading ``~`` was expanded when the
    config was composed (``compose.load_config``)."""
    return map_paths(cfg, lambda key, path: os.path.abspath(path))


def check_files(cfg: Config) -> None:
    """``ConfigError`` naming the key of the first file or directory the config names that is not
    there (nothing is downloaded: a path is always local)."""
    for role in ROLES:
        model = cfg.model(role)
        for key in ("function", "score_function"):
            if getattr(model, key) is not None:
                usercode.function_file(getattr(model, key), f"{role}.{key}")
        # Checked when the run starts, not at the first step: a missing token would stop it there.
        if model.url is not None and model.token_env is not None:
            token = os.environ.get(model.token_env)
            if not token:
                raise ConfigError(f"{role}.token_env", f"the environment variable "
                                                       f"{model.token_env} is not set (or empty); "
                                                       "allowed: the name of a variable holding "
                                                       "the reward server's token")
            rewards.clean_token(token, model.token_env, f"{role}.token_env")
        if model.tokenizer is not None and not Path(model.tokenizer).is_dir():
            raise ConfigError(f"{role}.tokenizer", f"no directory at {model.tokenizer!r}; "
                                                   "allowed: a local tokenizer directory, never "
                                                   "downloaded")
        if model.path is not None and not (Path(model.path) / "config.json").is_file():
            raise ConfigError(f"{role}.path", f"no Hugging Face model directory at "
                                              f"{model.path!r} (needs config.json); allowed: an "
                                              "existing local directory, models are never "
                                              "downloaded")
        if model.path is not None and not any(any(Path(model.path).glob(pattern))
                                              for pattern in WEIGHT_FILES):
            # Else from_pretrained in every worker, after Ray and the engines have started.
            raise ConfigError(f"{role}.path", f"{model.path!r} has a config.json but no weights "
                                              f"({', '.join(WEIGHT_FILES)}); allowed: a "
                                              "directory saved by save_pretrained, weights "
                                              "included")
    if cfg.env.function is not None:
        usercode.function_file(cfg.env.function, "env.function")
    if cfg.env.tools is not None and not Path(cfg.env.tools.rpartition(":")[0]).is_file():
        raise ConfigError("env.tools", f"no file {cfg.env.tools.rpartition(':')[0]!r}; "
                                       "allowed: an existing .py file")
    resume = cfg.trainer.resume
    if resume not in RESUME_CHOICES and not (Path(resume) / MANIFEST).is_file():
        raise ConfigError("trainer.resume", f"no complete checkpoint at {resume!r} (it has no "
                                            f"{MANIFEST}); allowed: auto, none or a checkpoint "
                                            "directory such as OUTPUT_DIR/checkpoints/step_10")
    for key in ("train_files", "val_files"):
        for file in data_files(getattr(cfg.data, key)):
            if not file.endswith((".json", ".jsonl", ".parquet")):
                raise ConfigError(f"data.{key}", f"{file!r} is not a data file; allowed: local "
                                                 ".json, .jsonl or .parquet files")
            if not Path(file).is_file():
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
    algorithm = dataclasses.replace(cfg.algorithm, kl_estimator=algorithms.kl_estimator(cfg))
    return dataclasses.replace(cfg, algorithm=algorithm, **deepspeed)


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
