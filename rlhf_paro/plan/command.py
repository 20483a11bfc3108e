"""Planner: per-device memory, traffic and predicted time of every strategy of every model, and
what to pick.

    python -m rlhf_paro.plan [--help] [--cfg job] [-m] [conf=NAME] [override ...]
    python -m rlhf_paro.plan conf=ppo_llama7b cluster.nodes=16 cluster.gpus_per_node=8
"""

from __future__ import annotations

import sys

from rlhf_paro import cli
from rlhf_paro.config import Config
from rlhf_paro.models import check_model_configs
from rlhf_paro.plan.printout import format_plan
from rlhf_paro.plan.search import make_plan
from rlhf_paro.plan.step import rollout_splits
from rlhf_paro.ppo.data import vocab_sizes
from rlhf_paro.resolve import resolve


def main(argv: list[str] | None = None) -> None:
    cli.main(sys.argv[1:] if argv is None else argv, prog="rlhf_paro.plan", about=_ABOUT,
             prepare=_prepare, execute=lambda cfg, _: print(_report(cfg)))


def _report(cfg: Config) -> str:
    sizes = vocab_sizes(cfg)
    return format_plan(cfg, make_plan(cfg, sizes), rollout_splits(cfg, sizes))


# --help: the first paragraph of this module's docstring.
_ABOUT = __doc__.split("\n\n")[0]


def _prepare(cfg: Config, conf: str) -> Config:
    """The run's config resolved (``rlhf_paro.resolve``: which models, their sources, the files
    they name), and its model sections checked."""
    cfg = resolve(cfg, engine_check=False)  # the engine is the run's to check, where it runs
    check_model_configs(cfg, vocab_sizes(cfg))
    return cfg
