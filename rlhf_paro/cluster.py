"""Where a run's workers live: Ray actor groups on the cluster's devices (``RayCluster``), or
every model in this process (``LocalCluster``, ``actors/local.py``). The trainer runs a step's
plan on either alike (``trainer.py``): both give the models' groups, the rollout source and a
``wait`` for results.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import ray

from rlhf_paro import sources
from rlhf_paro.actors.actor import ActorWorker
from rlhf_paro.actors.critic import CriticWorker
from rlhf_paro.actors.group import (
    Call, ModelGroup, RayOutput, get, init_ray, missing_devices, phase, place,
)
from rlhf_paro.actors.local import LocalGroup, check
from rlhf_paro.actors.ref import RefWorker
from rlhf_paro.actors.reward import RewardWorker
from rlhf_paro.config import RAY_ADDRESS_ALLOWED, Config, ConfigError
from rlhf_paro.ppo import algorithms
from rlhf_paro.ppo.data import rollout_tokenizer

WORKERS = {"actor": ActorWorker, "critic": CriticWorker, "reward": RewardWorker,
           "ref": RefWorker}


class RayCluster:
    """The run's models as Ray actor groups placed on the devices, and its rollout source.
    ``stop()``: SIGTERM asked the run to stop (a wait for the devices or the workers' start gives
    up then); ``output``: where the workers' lines go."""

    def __init__(self, cfg: Config, stop: Callable[[], bool],
                 output: RayOutput | None = None) -> None:
        self.cfg = cfg
        cluster = cfg.cluster
        num_devices, use_gpu = cluster.num_devices, cluster.device == "cuda"
        # The training devices, then the rollout's own (rollout.num_devices).
        replicas = cfg.rollout.num_devices
        # Each phase of the start that takes more than a few seconds says so in one line.
        say = output.say if output is not None else lambda line: print(line, flush=True)
        try:
            # Joining a cluster takes a second; a wait for its devices says so itself (place).
            with contextlib.nullcontext() if cfg.ray.address else \
                    phase("starting Ray on this machine", say):
                init_ray(cfg.ray.address, cfg.ray.num_cpus, num_devices + replicas, output)
        except ConnectionError as err:
            refused = "authentication" in str(err)  # a cluster that answers: the address is good
            raise ConfigError("ray.address", str(err) if refused else
                              f"{err}; {RAY_ADDRESS_ALLOWED}") from None
        problem = missing_devices(num_devices, cluster.group_size, use_gpu, replicas)
        if problem:
            key = "rollout.num_devices" if cfg.rollout.num_devices else "cluster.num_devices"
            raise ConfigError(key, problem)
        wait = dict(use_gpu=use_gpu, timeout_s=cfg.ray.placement_timeout_s, stop=stop, say=say)
        self.placement = place(num_devices, cluster.group_size, **wait)
        # Each replica a device of its own, on any node.
        try:
            replica_placement = place(replicas, 1, **wait) if replicas else None
        except BaseException:
            self.placement.remove()
            raise
        self.stop = stop
        self.stoppable = True  # a stop interrupts a wait; during the steps, it waits for one
        # Every model's calls since the last step's were done, in the order issued: what a
        # worker that does not answer is traced back to (actors/group.py, get).
        self.issued: list[Call] = []
        self.pids: dict[str, list[int]] = {}  # each model's process id per rank
        self.models = {role: ModelGroup(WORKERS[role], role, cfg, self.placement, use_gpu,
                                        self.issued)
                       for role in algorithms.roles(cfg)}
        # Where each step's rollout comes from: the actor's ranks, or replicas on devices of
        # their own (rollout.num_devices), each alone on its own.
        self.source = sources.make(cfg, self.models["actor"], self.wait,
                                   rollout_tokenizer(cfg).pad_token_id, replica_placement,
                                   self.issued, use_gpu)
        groups = self.groups()
        processes = sum(group.num_ranks for group in groups.values())
        with phase(f"starting {processes} worker processes ({', '.join(groups)})", say):
            self.wait(**{role: group.call("node") for role, group in groups.items()})
        # The models join their process groups and build their engines at once.
        with phase(f"building the models on {num_devices} device{'s' * (num_devices > 1)} "
                   "(process groups, weights, engines)", say):
            self.pids = self.wait(**{role: group.rendezvous()
                                     for role, group in self.models.items()})
        with phase(f"starting the rollout's {replicas} replica{'s' * (replicas > 1)}", say) \
                if replicas else contextlib.nullcontext():
            self.pids.update(self.source.start())
        self.issued.clear()

    def wait(self, **calls: list[ray.ObjectRef]) -> dict[str, list[Any]]:
        """The results of each model's calls (``model=refs``); a worker that dies or raises
        is a ``WorkerError`` at once, one that does not answer within
        ``trainer.step_timeout_s`` a ``NoAnswerError`` (``actors/group.py``, ``get``). A stop
        asked for while ``stoppable`` is a ``StopRequested`` at once."""
        placements = {**dict.fromkeys(self.models, self.placement), **self.source.placements()}
        return get(calls, {role: group.workers for role, group in self.groups().items()},
                   self.cfg.trainer.step_timeout_s, self.issued, self.pids,
                   self.stop if self.stoppable else None, placements)

    def groups(self) -> dict[str, ModelGroup]:
        """Every group of workers: the models', and the rollout source's own."""
        return {**self.models, **self.source.groups()}

    def shutdown(self) -> None:
        """Kill every worker (even one blocked in a collective) and free their devices."""
        for group in self.models.values():
            group.shutdown()
        self.placement.remove()
        self.source.shutdown()


class LocalCluster:
    """Every model of a run in this process (``actors/local.py``), the rollout in the actor's
    rank: for a run of one device, the same steps as a ``RayCluster`` of the same config without
    Ray; for a test's ``world`` gloo processes, rank ``rank`` of each model here."""

    def __init__(self, cfg: Config, rank: int = 0, world: int = 1, source: Any = None) -> None:
        check(cfg, world, dealt=source is None)
        self.cfg = cfg
        self.stoppable = True
        self.issued: list[Call] = []
        self.models = {role: LocalGroup(WORKERS[role], role, cfg, self.issued, rank, world)
                       for role in algorithms.roles(cfg)}
        # The actor's ranks, or a test's own source (tests/steps.py: its rollout each step).
        self.source = source or sources.make(cfg, self.models["actor"], self.wait,
                                             rollout_tokenizer(cfg).pad_token_id, None,
                                             self.issued, False)
        self.pids = {role: group.rendezvous() for role, group in self.models.items()}
        self.issued.clear()

    def wait(self, **calls: list[Any]) -> dict[str, list[Any]]:
        """The results, which are there: each call ran when it was issued."""
        return calls

    def groups(self) -> dict[str, LocalGroup]:
        return dict(self.models)

    def shutdown(self) -> None:
        """Nothing runs beyond this process."""
