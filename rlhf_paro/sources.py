"""Where a step's rollout comes from: the actor's own ranks (``Colocated``), or rollout replicas
on devices of their own (``Replicas``, docs/design.md, "Asynchronous rollouts"). The trainer
holds one ``RolloutSource`` and runs a step's stages over it (``ppo/pipeline.py``); nothing else
of the trainer depends on which one it is.

    launch     a step's prompt slices to the generators (replicas take the actor's newest
               weights first); gives the rollout on its way, references only, and keeps it
               (``Launched``) by step until it is collected
    collect    waits for a launched rollout and gives the training ranks' rollouts (dealt by
               real tokens with ``ppo.balance_batch``), the generators' sums and its staleness
    sync       the generators hold the actor's newest weights (before a greedy evaluation)
    save       the rollouts launched ahead, as values, into a checkpoint ([Note: rollouts
               launched ahead]); ``restore`` is the way back

``launch`` and ``collect`` are calls of the step's plan (``ppo/step.py``): each reads and gives
named values of one step.

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
from rlhf_paro.metrics import Sums
from rlhf_paro.ppo import pipeline
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
    calls: list[Call] = dataclasses.field(default_factory=list)  # its calls, for a hang

    @classmethod
    def from_checkpoint(cls, step: int, batches: list[RolloutBatch], meta: dict[str, Any]
                        ) -> Launched:
        """A rollout a checkpoint saved (``checkpoint.read_rollouts``), dealt as it was."""
        return cls(step=step, version=meta["version"], rollouts=batches,
                   stats=[Sums.from_dict(one) for one in meta["stats"]], rows=meta["rows"],
                   dealt=True, restored=True)


class RolloutSource:
    """What both sources do alike; ``launch``'s generation and dealing are each one's own."""

    role = "actor"  # the generators' name in a wait

    def __init__(self, cfg: Config, generators: ModelGroup, wait: Wait,
                 pad_token_id: int) -> None:
        self.cfg = cfg
        self.generators = generators
        self.wait = wait
        self.pad_token_id = pad_token_id  # of the rollouts it deals
        self.launched: dict[int, Launched] = {}  # by step: launched, not collected yet

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

    def launch(self, step: int, prompts: Any, version: int) -> dict[str, Any]:
        """Step ``step``'s rollout on its way (``prompts``: the slices and their rows, or None
        for a rollout a checkpoint restored), generated by policy ``version``."""
        if step not in self.launched:
            slices, rows = prompts
            issued = self.generators.issued
            before = len(issued)
            self.launched[step] = self._launch(step, slices, rows, version)
            self.launched[step].calls = issued[before:]
        return self._launch_gives(self.launched[step])

    def in_flight(self) -> list[Call]:
        """The calls of the rollouts launched and not collected: what a hang is traced to
        beyond the step's own calls."""
        return [c for one in self.launched.values() for c in one.calls]

    def _launch(self, step: int, prompts: list[Any], rows: list[Any] | None,
                version: int) -> Launched:
        raise NotImplementedError

    def _launch_gives(self, launched: Launched) -> dict[str, Any]:
        return {"generated": launched.rollouts, "prompt_rows": launched.rows}

    def holds(self, step: int) -> bool:
        """Whether step ``step``'s rollout is launched (or restored) and not collected."""
        return step in self.launched

    def collect(self, step: int, version: int, **launched: Any) -> dict[str, Any]:
        """Step ``step``'s rollout once it is there: the training ranks' ``rollout`` and
        ``rows``, the generators' ``gen_sums``, and its ``staleness`` against policy
        ``version``."""
        one = self.launched.pop(step)
        stats = one.stats if one.restored else self.wait(**{self.role: one.stats})[self.role]
        return {"rollout": one.rollouts, "rows": one.rows, "gen_sums": stats,
                "staleness": pipeline.staleness(version, one.version)}

    def sync(self, version: int) -> None:
        """The generators hold the weights of policy ``version`` (the actor's newest)."""

    def saved(self, launched: Launched) -> tuple[list[RolloutBatch], list[Sums],
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

    def save(self, directory: Path) -> None:
        """The rollouts launched ahead of the next step, waited for and written with the
        checkpoint.

        [Note: rollouts launched ahead]
        Saved, not generated again on resume: each was generated by a policy older than the
        checkpoint's (the one after update t - K), which only its rollout keeps. Written, the
        resumed run collects them as the straight run did, and launches the next with the
        checkpoint's policy, as the straight run would have: the same rows."""
        for step, one in sorted(self.launched.items()):
            batches, stats, rows = self.saved(one)
            checkpoint.write_rollouts(directory, step, batches, {
                "version": one.version, "num_ranks": len(batches),
                "stats": [s.to_dict() for s in stats], "rows": rows})

    def restore(self, directory: Path) -> None:
        """The rollouts a checkpoint saved (``save``), launched again as they were."""
        for step, (batches, meta) in checkpoint.read_rollouts(directory, RolloutBatch).items():
            self.launched[step] = Launched.from_checkpoint(step, batches, meta)

    def metrics(self, sums: Sums, step_s: float) -> dict[str, float]:
        """The source's own metrics of a step, from its generators' folded sums."""
        return {}

    def shutdown(self) -> None:
        """Stop the workers of its own and free their devices."""


class Colocated(RolloutSource):
    """Each actor rank generates its slice with the engine in its own process: the training
    ranks' rollouts are those they generated, or dealt again by real tokens by the driver
    (``ppo.balance_batch``, [Note: balanced ranks])."""

    def _launch(self, step: int, prompts: list[Any], rows: list[Any] | None,
                version: int) -> Launched:
        rollouts, stats = self.generate(prompts, rows, step)
        return Launched(step=step, version=version, rollouts=rollouts, stats=stats, rows=rows)

    def collect(self, step: int, version: int, **launched: Any) -> dict[str, Any]:
        one = self.launched[step]
        given = super().collect(step, version)
        if self.cfg.deals_rollouts and not one.dealt:
            given["rollout"], given["rows"] = self.balance(one.rollouts, one.rows)
        return given

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
        return [self.generators.put(batch) for batch in dealt], rows


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

    def _launch(self, step: int, prompts: list[Any], rows: list[Any] | None,
                version: int) -> Launched:
        self.sync(version)
        rollouts, stats = self.generate(prompts, rows, step)
        launched = Launched(step=step, version=version, stats=stats, dealt=True)
        launched.rollouts, launched.rows, launched.rows_pending = self._deal_ahead(rollouts, rows)
        return launched

    def _launch_gives(self, launched: Launched) -> dict[str, Any]:
        # Dealt to the training ranks as soon as they are generated: the rollout itself.
        return {"rollout": launched.rollouts, "rows": launched.rows}

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

    def collect(self, step: int, version: int, **launched: Any) -> dict[str, Any]:
        one = self.launched[step]
        given = super().collect(step, version)
        if not one.restored:  # the dealt rollouts are what the experience reads: there now
            self.wait(rollout=one.rollouts)
        return {"gen_sums": given["gen_sums"], "staleness": given["staleness"]}

    def metrics(self, sums: Sums, step_s: float) -> dict[str, float]:
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


def replica_metrics(sums: Sums, step_s: float, num_replicas: int
                    ) -> dict[str, float]:
    """``rollout/*`` of the replicas on devices of their own, from the sums their generations
    gave: seconds a replica generated and took weights for the step's rollout (means over
    replicas), what is left of the step's wall time (idle, or generating the next), and the
    weights' bytes they received."""
    generate = sums.total.get("replica_generate_s", 0.0) / num_replicas
    sync = sums.total.get("replica_sync_s", 0.0) / num_replicas
    return {"rollout/time_s/generate": generate, "rollout/time_s/sync": sync,
            "rollout/time_s/idle": max(0.0, step_s - generate - sync),
            "rollout/sync/received_bytes": sums.total.get("replica_received_bytes", 0.0)}
