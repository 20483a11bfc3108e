"""Where a step's rollout comes from: the actor's own ranks (``Colocated``), or rollout replicas
on devices of their own (``Replicas``, docs/design.md, "Asynchronous rollouts"). The trainer
holds one ``RolloutSource`` and runs a step's stages over it (``ppo/pipeline.py``); nothing else
of the trainer depends on which one it is.

    launch     a step's prompt slices to the generators (replicas take the actor's newest
               weights first); returns the ``Launched`` rollout on its way, references only
    collect    waits for a launched rollout and leaves in it the training ranks' rollouts
               (dealt by real tokens with ``ppo.balance_batch``); returns the generators' sums
    sync       the generators hold the actor's newest weights (before a greedy evaluation)
    saved      a launched rollout's values, for a checkpoint ([Note: rollouts launched ahead]);
               ``Launched.restored`` is the way back

A generator is the group whose ranks each take one slice of the prompts (``num_shards``) and
answer ``generate``; ``role`` names it in a wait, so that a failure names the worker.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

import ray
import torch

from rlhf_paro import batching, rollout, runs
from rlhf_paro.actors import checkpoint
from rlhf_paro.actors.group import Call, ModelGroup, Placement
from rlhf_paro.actors.rollout import RolloutWorker
from rlhf_paro.config import Config
from rlhf_paro.rollout import RolloutBatch

# ``PPOTrainer.wait``: the results of each role's calls (``role=refs``), failures named.
Wait = Callable[..., dict[str, list[Any]]]


@dataclasses.dataclass
class Launched:
    """A step's rollout on its way (``pipeline.LAUNCH`` to ``COLLECT``)."""

    step: int
    version: int  # updates of the policy that generates it
    rollouts: list[Any] = dataclasses.field(default_factory=list)  # refs, or the rollouts
    stats: list[Any] = dataclasses.field(default_factory=list)  # sums per generator
    rows: list[Any] | None = None  # the prompts' texts and columns, per slice
    dealt: bool = False  # ``rollouts`` and ``rows`` are the training ranks' already
    restored: bool = False  # read from a checkpoint: values, not references, and dealt
    rows_pending: bool = False  # ``rows`` are references (dealt by a task still running)
    # (scores, their sums, the reward's reports or None) started with it (``PPOTrainer._score``)
    scores: tuple[list[Any], list[Any], list[Any] | None] | None = None
    calls: list[Call] = dataclasses.field(default_factory=list)  # its calls, for a hang

    @classmethod
    def from_checkpoint(cls, step: int, batches: list[RolloutBatch], meta: dict[str, Any]
                        ) -> Launched:
        """A rollout a checkpoint saved (``checkpoint.read_rollouts``), dealt as it was."""
        return cls(step=step, version=meta["version"], rollouts=batches, stats=meta["stats"],
                   rows=meta["rows"], dealt=True, restored=True)


class RolloutSource:
    """What both sources do alike; ``launch``'s generation and dealing are each one's own."""

    role = "actor"  # the generators' name in a wait
    scores_ahead = False  # a reward that reads nothing trained scores a launch as it ends

    def __init__(self, cfg: Config, generators: ModelGroup, wait: Wait,
                 pad_token_id: int) -> None:
        self.cfg = cfg
        self.generators = generators
        self.wait = wait
        self.pad_token_id = pad_token_id  # of the rollouts it deals

    @property
    def num_shards(self) -> int:
        """The slices a step's prompts are cut into: one per generator."""
        return self.generators.num_ranks

    def groups(self) -> dict[str, ModelGroup]:
        """The groups of workers of its own (beyond the models'), by role."""
        return {}

    def placements(self) -> dict[str, Placement]:
        """Where each group of its own is placed, by role."""
        return {}

    def start(self) -> dict[str, list[int]]:
        """Set up the workers of its own once the models are; their process ids by role."""
        return {}

    def generate(self, prompts: list[Any], rows: list[Any] | None, step: int,
                 greedy: bool = False) -> tuple[list[Any], list[Any]]:
        """Each generator's rollout and sums of its slice (references); ``rows`` go along to an
        environment's episodes."""
        episode_rows = (rows,) if self.cfg.env.enabled else ()
        extra = {"greedy": True} if greedy else {}
        rollouts, stats = zip(*self.generators.call("generate", prompts, *episode_rows,
                                                    step=step, num_returns=2, **extra))
        return list(rollouts), list(stats)

    def launch(self, step: int, prompts: list[Any], rows: list[Any] | None,
               version: int) -> Launched:
        raise NotImplementedError

    def collect(self, launched: Launched) -> list[dict[str, float]]:
        """The generators' sums of ``launched`` once it is there; its rollouts are the
        training ranks' after it."""
        if launched.restored:
            return launched.stats
        return self.wait(**{self.role: launched.stats})[self.role]

    def sync(self, version: int) -> None:
        """The generators hold the weights of policy ``version`` (the actor's newest)."""

    def saved(self, launched: Launched) -> tuple[list[RolloutBatch], list[dict[str, float]],
                                                 list[Any] | None]:
        """A launched rollout's batches, sums and rows as values, waited for."""
        if launched.restored:
            return launched.rollouts, launched.stats, launched.rows
        batches = self.wait(**{self.role: launched.rollouts})[self.role]
        stats = self.wait(**{self.role: launched.stats})[self.role]
        rows = launched.rows
        if launched.rows_pending:
            rows = self.wait(**{self.role: rows})[self.role]
        return batches, stats, rows

    def metrics(self, sums: dict[str, float], step_s: float) -> dict[str, float]:
        """The source's own metrics of a step, from its generators' summed stats."""
        return {}

    def shutdown(self) -> None:
        """Stop the workers of its own and free their devices."""


class Colocated(RolloutSource):
    """Each actor rank generates its slice with the engine in its own process: the training
    ranks' rollouts are those they generated, or dealt again by real tokens by the driver
    (``ppo.balance_batch``, [Note: balanced ranks])."""

    def launch(self, step: int, prompts: list[Any], rows: list[Any] | None,
               version: int) -> Launched:
        rollouts, stats = self.generate(prompts, rows, step)
        return Launched(step=step, version=version, rollouts=rollouts, stats=stats, rows=rows)

    def collect(self, launched: Launched) -> list[dict[str, float]]:
        stats = super().collect(launched)
        if self.cfg.deals_rollouts and not launched.dealt:
            launched.rollouts, launched.rows = self.balance(launched.rollouts, launched.rows)
            launched.dealt = True
        return stats

    def balance(self, rollouts: list[ray.ObjectRef], rows: list[Any] | None
                ) -> tuple[list[ray.ObjectRef], list[Any] | None]:
        """The step's rollout dealt to the actor's ranks by real tokens ([Note: balanced
        ranks], ``batching.rank_order``); returns each rank's rows (the actor takes them with
        its ``old_logprobs`` call, the other models as their rollout) and the prompts' rows
        dealt alike. The rollouts are token ids and masks, small next to anything a model
        computes from them."""
        cfg = self.cfg
        whole = RolloutBatch.concat(self.wait(actor=rollouts)["actor"], self.pad_token_id)
        dealt, rows = deal(whole, cfg.rollout.n, cfg.cluster.num_devices,
                           cfg.ppo.mini_batch_size // cfg.cluster.num_devices, True, rows)
        return [ray.put(batch) for batch in dealt], rows


class Replicas(RolloutSource):
    """Rollout replicas on devices of their own (``rollout.num_devices``), each alone on its
    device: the actor's ranks send them the weights of every new policy (``comm/transfer.py``),
    and a task deals their rollouts to the training ranks as soon as they are generated, the
    driver not waiting."""

    role = "rollout"

    def __init__(self, cfg: Config, generators: ModelGroup, wait: Wait, pad_token_id: int,
                 actor: ModelGroup, placement: Placement) -> None:
        super().__init__(cfg, generators, wait, pad_token_id)
        self.actor = actor
        self.placement = placement
        self.weights_sent = -1  # the policy version the replicas hold
        # Whether the replicas hold a LoRA actor's base weights (sent with their first sync,
        # where they take adapters: ``rollout.lora_sync``).
        self.base_sent = False
        # A reward that reads nothing trained scores a rollout launched ahead as soon as it is
        # generated, while training goes on (a function, a server, the environment's score).
        self.scores_ahead = cfg.rollout.max_staleness > 0 and not cfg.reward.runs_model
        self._store = None  # the transfer groups' store, held while the run goes on

    def groups(self) -> dict[str, ModelGroup]:
        return {self.role: self.generators}

    def placements(self) -> dict[str, Placement]:
        return {self.role: self.placement}

    def start(self) -> dict[str, list[int]]:
        """The replicas' engines, and the transfer group of each actor rank and the replicas
        it serves (``comm/transfer.py``), on a store this driver holds."""
        from rlhf_paro.comm import transfer

        actor, replicas = self.actor, self.generators
        num_ranks, num_replicas = actor.num_ranks, replicas.num_ranks
        host = ray.util.get_node_ip_address()
        self._store, port = transfer.serve_store(host)
        manifest = self.wait(actor=actor.call("weight_manifest"))["actor"][0]
        nodes = self.wait(actor=actor.call("node"), rollout=replicas.call("node"))
        joins = {}
        for rank in range(num_ranks):
            served = transfer.served(rank, num_ranks, num_replicas)
            if served:
                same = [nodes["rollout"][j] == nodes["actor"][rank] for j in served]
                joins.setdefault("actor", []).append(actor.workers[rank].join_transfer.remote(
                    host, port, same))
        setups = []
        for j, worker in enumerate(replicas.workers):
            source = transfer.serving(j, num_ranks)
            group = transfer.served(source, num_ranks, num_replicas)
            setups.append(worker.setup.remote(host, port, source, group.index(j) + 1,
                                              len(group) + 1, manifest))
        return {self.role: self.wait(rollout=setups, **joins)["rollout"]}

    def sync(self, version: int) -> None:
        """The actor's weights to every replica when they hold an older policy: the actor's
        ranks gather and send while the replicas take them, once the replicas are done with
        what they were generating."""
        if self.weights_sent == version:
            return
        self.actor.call("send_weights", base=not self.base_sent)
        self.generators.call("receive_weights", base=not self.base_sent)
        self.weights_sent, self.base_sent = version, True

    def launch(self, step: int, prompts: list[Any], rows: list[Any] | None,
               version: int) -> Launched:
        self.sync(version)
        rollouts, stats = self.generate(prompts, rows, step)
        launched = Launched(step=step, version=version, stats=stats, dealt=True)
        launched.rollouts, launched.rows, launched.rows_pending = self._deal_ahead(rollouts, rows)
        return launched

    def _deal_ahead(self, rollouts: list[ray.ObjectRef], rows: list[Any] | None
                    ) -> tuple[list[ray.ObjectRef], list[Any] | None, bool]:
        """The replicas' rollouts as the training ranks' (each rank's ref of its own), and
        whether their rows are references: as generated when there are as many replicas as
        ranks and the ranks are not balanced, else dealt by a task that runs once they are
        there (``deal``)."""
        cfg = self.cfg
        num_ranks = cfg.cluster.num_devices
        if len(rollouts) == num_ranks and not cfg.deals_rollouts:
            return rollouts, rows, False
        parts = list(_deal_task.options(num_returns=2 * num_ranks).remote(
            self.pad_token_id, cfg.rollout.n, num_ranks, cfg.ppo.mini_batch_size // num_ranks,
            cfg.ppo.balance_batch, rows, *rollouts))
        if rows is None:
            return parts[:num_ranks], None, False
        return parts[:num_ranks], parts[num_ranks:], True

    def collect(self, launched: Launched) -> list[dict[str, float]]:
        stats = super().collect(launched)
        if not launched.restored:  # the dealt rollouts are what the experience reads: there now
            self.wait(rollout=launched.rollouts)
        return stats

    def metrics(self, sums: dict[str, float], step_s: float) -> dict[str, float]:
        return replica_metrics(sums, step_s, self.generators.num_ranks)

    def shutdown(self) -> None:
        self.generators.shutdown()
        self.placement.remove()


def make(cfg: Config, actor: ModelGroup, wait: Wait, pad_token_id: int,
         placement: Placement | None, issued: list[Call], use_gpu: bool) -> RolloutSource:
    """The run's source: replicas on ``placement`` (``rollout.num_devices`` devices of their
    own, one replica each), or the actor's ranks where it is None. Says in one line when a LoRA
    actor's engines take merged weights where the config asked for adapters
    (``rollout.lora_sync``)."""
    line = rollout.lora_sync(cfg)[1]
    if line is not None:
        print(line, flush=True)
    if placement is None:
        return Colocated(cfg, actor, wait, pad_token_id)
    replicas = ModelGroup(RolloutWorker, "rollout", cfg, placement, use_gpu, issued, share=1.0)
    return Replicas(cfg, replicas, wait, pad_token_id, actor, placement)


def deal(whole: RolloutBatch, group_size: int, num_ranks: int, mini_size: int, balance: bool,
         rows: list[Any] | None) -> tuple[list[RolloutBatch], list[Any] | None]:
    """A step's whole rollout cut into the training ranks' (``balance``: by real tokens, groups
    of ``rollout.n`` whole, [Note: balanced ranks]; else in order), each trimmed to its own
    widths, and the prompts' rows dealt alike."""
    if balance:
        order = batching.rank_order(whole.num_tokens(), group_size, num_ranks, mini_size)
    else:
        order = list(torch.arange(len(whole)).chunk(num_ranks))
    return ([whole.select(index).trimmed() for index in order],
            None if rows is None else runs.deal_rows(rows, order))


@ray.remote(num_cpus=0)
def _deal_task(pad_token_id: int, group_size: int, num_ranks: int, mini_size: int,
               balance: bool, rows: list[Any] | None, *rollouts: RolloutBatch) -> tuple:
    """``deal`` of the replicas' rollouts, run by Ray as soon as they are generated: one
    result per training rank's rollout, then one per rank's rows."""
    dealt, dealt_rows = deal(RolloutBatch.concat(rollouts, pad_token_id), group_size, num_ranks,
                             mini_size, balance, rows)
    return (*dealt, *(dealt_rows or [None] * num_ranks))


def replica_metrics(sums: dict[str, float], step_s: float, num_replicas: int
                    ) -> dict[str, float]:
    """``rollout/*`` of the replicas on devices of their own, from the sums their generations
    gave: seconds a replica generated and took weights for the step's rollout (means over
    replicas), what is left of the step's wall time (idle, or generating the next), and the
    weights' bytes they received."""
    generate = sums.get("replica_generate_s", 0.0) / num_replicas
    sync = sums.get("replica_sync_s", 0.0) / num_replicas
    return {"rollout/time_s/generate": generate, "rollout/time_s/sync": sync,
            "rollout/time_s/idle": max(0.0, step_s - generate - sync),
            "rollout/sync/received_bytes": sums.get("replica_received_bytes", 0.0)}


def save_launched(source: RolloutSource, launched: dict[int, Launched], directory: Path) -> None:
    """The rollouts launched ahead of the next step, waited for and written with the
    checkpoint.

    [Note: rollouts launched ahead]
    Saved, not generated again on resume: each was generated by a policy older than the
    checkpoint's (the one after update t - K), which only its rollout keeps. Written, the
    resumed run collects them as the straight run did, and launches the next with the
    checkpoint's policy, as the straight run would have: the same rows."""
    for step, one in sorted(launched.items()):
        batches, stats, rows = source.saved(one)
        checkpoint.write_rollouts(directory, step, batches, {
            "version": one.version, "num_ranks": len(batches), "stats": stats, "rows": rows})
