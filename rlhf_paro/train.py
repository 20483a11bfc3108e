"""``python -m rlhf_paro.train [conf=NAME] [key=value ...]``: RLHF PPO, a PaRO strategy per model.

With no arguments it runs ``conf/ppo_tiny.yaml`` on this machine's CPUs. See ``conf/`` for every
key and ``python -m rlhf_paro.plan`` to choose strategies for a cluster.
"""

from __future__ import annotations

import sys

import ray
import torch

from rlhf_paro.actors.group import init_ray
from rlhf_paro.config import Config, ConfigError, cli_errors, load_config, parse_overrides


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    with cli_errors():
        cfg = load_config(argv)
        require_gpus(cfg, conf=parse_overrides(argv)[0])
        # Everything below needs transformers; a bad command line has failed before it.
        from rlhf_paro import models, plan
        from rlhf_paro.ppo.task import task_from_config
        from rlhf_paro.trainer import PPOTrainer

        models.check_model_configs(cfg, task_from_config(cfg).tokenizer.vocab_size)
        cfg = plan.resolve_auto(cfg)
        trainer = PPOTrainer(cfg)
    dashboard = trainer.fit()
    trainer.shutdown()
    print(f"metrics: {cfg.trainer.output_dir}/metrics.jsonl\ndashboard: {dashboard}")


def require_gpus(cfg: Config, conf: str) -> None:
    """Fail at once, before any work, when a GPU conf does not find its GPUs."""
    if cfg.cluster.device != "cuda":
        return
    need = cfg.cluster.num_devices
    shape = f"{need} CUDA GPUs ({cfg.cluster.num_groups} groups x {cfg.cluster.group_size})"
    advice = ("; run the CPU demo with `python -m rlhf_paro.train` (conf=ppo_tiny) or size this "
              f"conf with `python -m rlhf_paro.plan conf={conf}`")
    if not cfg.ray.address:
        have = torch.cuda.device_count()
        if have < need:
            raise ConfigError("cluster.device", f"conf {conf} needs {shape} and this machine "
                                                f"has {have}{advice}")
        return
    try:
        init_ray(cfg.ray.address, None, need)
    except ConnectionError:
        raise ConfigError("ray.address", f"conf {conf} needs {shape} on a Ray cluster and none "
                          f"runs at {cfg.ray.address!r} (start one with `ray start --head` and "
                          f"`ray start --address=HEAD:6379` on the other nodes){advice}") from None
    have = int(ray.cluster_resources().get("GPU", 0))
    if have < need:
        raise ConfigError("cluster.device", f"conf {conf} needs {shape} and the Ray cluster at "
                                            f"{cfg.ray.address!r} has {have}{advice}")


if __name__ == "__main__":
    main()
