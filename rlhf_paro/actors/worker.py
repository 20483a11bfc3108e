"""The per-rank worker every role builds on: its own process group, its model, its engine.

A worker is one Ray actor: rank r of one model. ``setup`` joins the model's own process group
(gloo on CPU, NCCL on GPU), builds the model identically on every rank (same seed), and hands
it to the engine of the model's backend (``sharding.contract``: the PaRO engine under its
strategy, or DeepSpeed ZeRO), which it drives through the ``TrainEngine`` contract alone. On
the PaRO engine a model read from files is built on the meta device and each rank reads only
its shards from them (docs/design.md, "Setup"). The driver
calls the role's methods on all ranks at once; between steps it collects one ``RankReport`` per
rank (``report``), which also resets the step's timers, the engine's comm meter and its count of
host transfers.

``Worker`` is all a frozen model (ref, reward) is; ``TrainedWorker`` adds what the models PPO
trains (actor, critic) need: an optimizer, the PPO epochs over the rollout, training statistics,
the count of optimizer steps the engine skipped.

Between steps a worker holds nothing but its engine and its random number generators, so a
checkpoint (``save_checkpoint``) is the engine's files plus a small JSON of the generators and
counters (``actors/checkpoint.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import time
from collections import defaultdict
from typing import Any, Callable, Iterator, NamedTuple

import psutil
import ray
import torch
import torch.distributed as dist
import transformers

from rlhf_paro import batching, models
from rlhf_paro.actors import checkpoint
from rlhf_paro.comm import transfer
from rlhf_paro.config import ConfigError
from rlhf_paro.metrics import GENERATE, INFERENCE, ROLE_PHASES, SYNC, TRAIN, RankReport
from rlhf_paro.ppo import algorithms, core, data
from rlhf_paro.rollout import RolloutBatch
from rlhf_paro.sharding import Topology
from rlhf_paro.sharding.contract import EngineOptions, ModelFactory, TrainEngine, build_engine

# Debugging aid (README, "Checkpoints and resume"): ROLE:RANK:STEP makes that rank's loss NaN
# throughout that PPO step, to see the skipped-step guard at work. Read by the workers, which
# inherit it from the driver that starts a private Ray.
# torch's own thread setter, taken before anything can replace it: once its engine is built,
# vLLM's CPU worker swaps torch.set_num_threads for one that does nothing ("doesn't allow to use
# torch.set_num_threads after the thread binding"), which left every phase of a rank with a vLLM
# engine on the one thread it had then, its training and forwards at half speed on two cores.
set_num_threads = torch.set_num_threads
NAN_LOSS_ENV = "RLHF_PARO_NAN_LOSS"


# How long a rank waits to reach its model's rendezvous store and for the other ranks there:
# torch's default for a process group's (the group itself keeps its backend's default).
RENDEZVOUS_TIMEOUT = dist.constants.default_pg_timeout


class StepError(RuntimeError):
    """A value of a step's plan given twice, read twice or never given (``Worker.run``)."""


class Worker:
    """Rank ``rank`` of model ``role`` (one of actor, critic, reward, ref)."""

    trained = False  # TrainedWorker overrides: its engine gets an optimizer

    def __init__(self, cfg: Any, role: str, rank: int, num_ranks: int) -> None:
        self.cfg = cfg
        self.role = role
        self.model_cfg = getattr(cfg, role)
        self.rank = rank
        self.num_ranks = num_ranks
        # Ray hides the other GPUs of the node: the bundle's GPU is always device 0.
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        # Torch threads per role phase on a CPU device (``phase_threads``); 1 outside them.
        self._threads = phase_threads(cfg, role) if self.device.type == "cpu" else {}
        if self._threads:
            set_num_threads(1)
        self.engine: TrainEngine | None = None  # None: a reward function or server
        self._rendezvous: dist.TCPStore | None = None  # rank 0's, served (``serve_rendezvous``)
        self.packed = False  # forwards on packed real tokens (set at setup from the model type)
        self._time_s: dict[str, float] = defaultdict(float)  # role phase -> seconds, this step
        self._tokens = 0  # token positions the model computed on, this step
        self._real_tokens = 0  # of which real tokens (the rest is padding)
        # Values of a step's plan kept here for a later call of the same model, by
        # (step, name) (``run``, ``ppo/step.py``).
        self._kept: dict[tuple[int, str], Any] = {}

    # -- a step's plan (ppo/step.py) ------------------------------------------------------------
    def run(self, method: str, step: int, returns: tuple[str, ...] = (),
            keeps: tuple[str, ...] = (), takes: tuple[str, ...] = (), *after: Any,
            **sent: Any) -> Any:
        """One call of step ``step``'s plan: ``method(step=step, **values)`` with the values it
        reads, those ``sent`` to it and those ``takes`` names, which an earlier call of this
        model kept here; ``after``: values it waited for (Ray runs the call once they are
        there) and does not read. The method gives a dict of named values: ``keeps`` stay here for a
        later call, ``returns`` go back, in order (one value, or a tuple of them). A value
        the method gives that the plan does not name, or one it names that the method does not
        give, is a ``StepError`` naming it."""
        values = dict(sent)
        for name in takes:
            values[name] = self._take(step, name)
        given = getattr(self, method)(step=step, **values) or {}
        wanted = set(returns) | set(keeps)
        if set(given) != wanted:
            raise StepError(f"{self.role}.{method} at step {step} gave "
                            f"{', '.join(sorted(given)) or 'nothing'}; its plan names "
                            f"{', '.join(sorted(wanted)) or 'nothing'}")
        for name in keeps:
            self._keep(step, name, given[name])
        out = tuple(given[name] for name in returns)
        return out if len(out) > 1 else (out[0] if out else None)

    def _keep(self, step: int, name: str, value: Any) -> None:
        if (step, name) in self._kept:
            raise StepError(f"{self.role} rank {self.rank}: step {step}'s {name!r} is given "
                            "twice")
        self._kept[(step, name)] = value

    def _take(self, step: int, name: str) -> Any:
        try:
            return self._kept.pop((step, name))
        except KeyError:
            raise StepError(f"{self.role} rank {self.rank}: step {step}'s {name!r} was never "
                            "kept here, or was read already") from None

    def kept(self) -> list[tuple[int, str]]:
        """The (step, name) of every value kept here and not read yet."""
        return sorted(self._kept)

    def reported(self, step: int) -> dict[str, RankReport]:
        """The step's report (``report``), as a value of its plan."""
        return {f"{self.role}_report": self.report()}

    # -- rendezvous --------------------------------------------------------------------------
    def node(self) -> str:
        """The address of this worker's node (which links a transfer to it crosses)."""
        return ray.util.get_node_ip_address()

    def serve_rendezvous(self) -> tuple[str, int]:
        """This node's IP and the port of the store the model's ranks meet on, which this rank
        (rank 0) serves from now on (``transfer.serve_store``): listened on from the moment the
        system draws the port, where a port found free and released until the process group
        listened on it could be taken by another process in between (EADDRINUSE at setup)."""
        host = ray.util.get_node_ip_address()
        self._rendezvous, port = transfer.serve_store(host)
        return host, port

    def setup(self, master_addr: str, master_port: int) -> int:
        """Join this model's process group, build the model and shard it; returns this
        worker's process id."""
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if backend == "gloo":
            bind_gloo(ray.util.get_node_ip_address())
        store = self._rendezvous if self._rendezvous is not None else dist.TCPStore(
            master_addr, master_port, is_master=False, timeout=RENDEZVOUS_TIMEOUT)
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.num_ranks)
        self.shard_model()
        return os.getpid()

    def shard_model(self) -> None:
        """Build the model and shard it on this model's process group, which this process has
        joined (``setup``; a test's gloo ranks join their own)."""
        topology = Topology.from_process_group(group_size=self.cfg.cluster.group_size)
        # N ranks x 4 models loading weights would each draw a progress bar.
        transformers.utils.logging.disable_progress_bar()
        # Built from the same seed on every rank (and ref from the actor's): identical weights.
        # The backend builds the model the way it shards it (ModelFactory).
        vocab_size = data.vocab_sizes(self.cfg)[self.role]
        # Every forward on the real tokens only, where the architecture allows (``batching``).
        self.packed = models.packs(self.model_cfg, models.hf_config(
            self.role, self.model_cfg, vocab_size).model_type)
        args = (self.role, self.model_cfg, vocab_size)
        seed = self.cfg.trainer.seed
        factory = ModelFactory(lambda: models.build_for_setup(*args, seed=seed),
                               lambda: models.build_model(*args, seed=seed))
        self.engine = build_engine(factory, topology, engine_options(
            self.cfg, self.role, self.trained, self.device))
        self.park()  # offload=params: parked until the model's first phase
        # Each rank samples and shuffles differently from here on.
        torch.manual_seed(self.cfg.trainer.seed * 1000 + self.rank + 1)
        return os.getpid()

    # -- offload=params: the model's parameters in host memory between its phases ---------------
    def park(self) -> None:
        """Move the parameters to host memory (offload=params; otherwise nothing)."""
        if self.model_cfg.offload == "params":
            self.engine.offload_params()

    def unpark(self) -> None:
        """Bring parked parameters back to the device for a phase (no-op when not parked)."""
        if self.model_cfg.offload == "params":
            self.engine.onload_params()

    @contextlib.contextmanager
    def on_device(self) -> Iterator[None]:
        """The parameters on the device for one phase, parked again after it if they were."""
        parked = self.model_cfg.offload == "params" and self.engine.params_offloaded
        self.unpark()
        try:
            yield
        finally:
            if parked:
                self.park()

    # -- per-step accounting -----------------------------------------------------------------
    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Time a role phase (``generate``, ``inference``, ``train``), on its threads."""
        start = time.perf_counter()
        try:
            with self.threads(phase):
                yield
        finally:
            self._time_s[phase] += time.perf_counter() - start

    @contextlib.contextmanager
    def threads(self, phase: str) -> Iterator[None]:
        """Torch's threads for ``phase`` (``phase_threads``; one outside the phases). Set
        whatever the count is, one included: a vLLM engine in this process sets its own count
        when it binds its threads, and a phase left on it would cut its sums into other parts
        than the same phase in a process without the engine (a rollout replica's run against
        the colocated one, docs/design.md, "CPU threads")."""
        if not self._threads:  # a GPU's worker: torch's CPU threads are left as they are
            yield
            return
        threads = self._threads.get(phase, 1)
        if torch.get_num_threads() != threads:
            set_num_threads(threads)
        try:
            yield
        finally:
            if torch.get_num_threads() != 1:
                set_num_threads(1)

    def count_tokens(self, attention_mask: torch.Tensor, packed: bool | None = None) -> None:
        """Count a forward over rows with this ``attention_mask``: the token positions it
        computes on (the real tokens when packed, every position of the padded rows otherwise;
        ``packed`` None: as this worker's forwards run) and the real tokens among them."""
        real = int(attention_mask.sum())
        self._tokens += real if (self.packed if packed is None else packed) \
            else attention_mask.numel()
        self._real_tokens += real

    def report(self) -> RankReport:
        """This step's report; resets the timers, the token count and the comm meter."""
        report = RankReport(
            tokens=self._tokens,
            real_tokens=self._real_tokens,
            time_s=dict(self._time_s),
            comm=self.engine.meter.by_phase(),
            memory=self.engine.memory(),
            peak_bytes=peak_bytes(self.device),
            offload=self.engine.transfers.totals(),
        )
        self._time_s.clear()
        self._tokens = self._real_tokens = 0
        self.engine.meter.reset()
        self.engine.transfers.reset()
        return report

    # -- checkpoints (actors/checkpoint.py) ----------------------------------------------------
    def save_checkpoint(self, directory: str) -> None:
        """This rank's engine state into ``directory/<role>/``, its own state into
        ``directory/workers/``."""
        if self.engine is not None:  # a reward function has no state but its generators
            self.engine.save_checkpoint(os.path.join(directory, self.role))
        checkpoint.write_json(checkpoint.worker_file(directory, self.role, self.rank),
                              {"num_ranks": self.num_ranks, "rng": checkpoint.rng_state(),
                               **self.counters()})

    def load_checkpoint(self, directory: str) -> None:
        """Undo ``save_checkpoint``; the engine reads the slices this rank owns under this
        strategy. The generators come back only on as many ranks as wrote them: on other N,
        each rank keeps its own fresh seed."""
        if self.engine is not None:
            self.engine.load_checkpoint(os.path.join(directory, self.role))
        path = checkpoint.worker_file(directory, self.role, self.rank)
        if not path.is_file():  # more ranks than wrote the checkpoint: counters are global
            path = checkpoint.worker_file(directory, self.role, 0)
        saved = json.loads(path.read_text())
        if saved["num_ranks"] == self.num_ranks:
            checkpoint.set_rng_state(saved["rng"])
        self.set_counters(saved)

    def counters(self) -> dict[str, int]:
        """What the worker counts across steps (a trained worker's skipped steps)."""
        return {}

    def set_counters(self, saved: dict[str, Any]) -> None:
        pass

    def digest(self, paths: list[str]) -> list[tuple[int, str]]:
        """(bytes, SHA-256) of each file, flushed to disk: the ranks share the hashing of a
        checkpoint's files."""
        return [checkpoint.file_digest(path) for path in paths]

    def all_reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        """Sum small statistics over this model's ranks (outside the engine: not metered)."""
        values = values.to(self.device)
        dist.all_reduce(values)
        return values.cpu()

    def all_reduce_max(self, values: torch.Tensor) -> torch.Tensor:
        """The largest of small integers over this model's ranks (outside the engine)."""
        values = values.to(self.device)
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        return values.cpu()

    def in_micro_batches(self, rollout: RolloutBatch,
                         fn: Callable[[RolloutBatch], torch.Tensor]) -> torch.Tensor:
        """The forward ``fn`` on ``micro_batch_size`` rows at a time (bounds activation memory),
        its tokens counted, results concatenated on the CPU, ready to travel."""
        out = []
        for idx in batching.split_by_rows(torch.arange(len(rollout)),
                                          self.model_cfg.micro_batch_size):
            rows = rollout.select(idx)
            self.count_tokens(rows.attention_mask)
            out.append(fn(rows).float().cpu())
        return torch.cat(out)

    def forward(self, batch: RolloutBatch, train: bool = False, **kwargs: Any) -> torch.Tensor:
        """The model's forward on rows of a rollout (log-probs, values or scores)."""
        self.engine.module.train(train)
        return self.engine(input_ids=batch.sequences.to(self.device),
                           attention_mask=batch.attention_mask.to(self.device),
                           packed=self.packed, **kwargs)


class FirstForward(NamedTuple):
    """The update's first pass of mini-batches, drawn ahead of it, and the output of the
    forward of its first micro-batch (``TrainedWorker.forward_first``)."""

    minis: list[tuple[list[batching.MicroBatch], float]]
    output: Any


class TrainedWorker(Worker):
    """A model that PPO trains (actor, critic): sharded with an optimizer, updated by
    ``ppo_update``, and its report carries the step's training statistics."""

    trained = True

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._train_stats: dict[str, list[float]] = defaultdict(list)  # name -> values, this step
        self._skipped = 0  # optimizer steps the engine skipped (non-finite loss or norm), in all
        self._skip_run = 0  # of which the latest in a row
        self._longest_skip_run = 0  # the longest run in a row seen during this step
        self._applied = 0  # optimizer steps applied (not skipped) during this step

    def record_train(self, stats: dict[str, float]) -> None:
        for key, value in stats.items():
            self._train_stats[key].append(float(value))

    def report(self) -> RankReport:
        """The step's report with the means of its training statistics and the skipped-step
        counts; resets the statistics."""
        report = super().report()
        report.train = {k: sum(v) / len(v) for k, v in self._train_stats.items()}
        report.train["skipped_steps"] = float(self._skipped)
        report.skip_run, report.applied = self._longest_skip_run, self._applied
        self._train_stats.clear()
        self._applied = 0
        self._longest_skip_run = self._skip_run  # a run in a row goes on into the next step
        return report

    def counters(self) -> dict[str, int]:
        return {"skipped": self._skipped, "skip_run": self._skip_run}

    def set_counters(self, saved: dict[str, Any]) -> None:
        self._skipped, self._skip_run = saved["skipped"], saved["skip_run"]
        self._longest_skip_run = self._skip_run

    def ppo_update(self, rollout: RolloutBatch,
                   micro_loss: Callable[[torch.Tensor, float, Any], tuple[torch.Tensor, dict]],
                   step: int, agg: str = "token_mean", first: FirstForward | None = None
                   ) -> None:
        """``ppo.ppo_epochs`` passes over this rank's ``rollout``; one optimizer step per
        mini-batch.

        ``micro_loss(indices, divisor, output)`` returns the loss of one micro-batch (rows
        ``indices`` of the rollout) and its metrics; ``divisor`` makes it a share of the global
        mini-batch's aggregate ``agg`` (``core.aggregate``: the global count of tokens or
        sequences over ranks x micro-batches); ``output`` is the forward ``first`` ran ahead for
        the first micro-batch (``forward_first``), else None. ``step`` is the PPO step. A filler
        micro-batch ([Note: micro-batches by tokens]) runs with its loss times 0 and records no
        metrics.
        """
        poisoned = os.environ.get(NAN_LOSS_ENV) == f"{self.role}:{self.rank}:{step}"
        for epoch in range(self.cfg.ppo.ppo_epochs):
            ahead = first is not None and epoch == 0
            planned = first.minis if ahead else self._mini_batches(rollout, agg)
            for m, (micros, divisor) in enumerate(planned):
                self.engine.set_micro_batches(len(micros))
                for k, micro in enumerate(micros):
                    self.count_tokens(rollout.attention_mask[micro.rows])
                    output = first.output if ahead and m == 0 and k == 0 else None
                    with self.timed(TRAIN):
                        loss, stats = micro_loss(micro.rows, divisor, output)
                        if micro.weight != 1.0:
                            loss = loss * micro.weight
                        if poisoned:
                            loss = loss * float("nan")
                        self.engine.backward(loss)
                    if micro.weight:
                        self.record_train({"loss": loss.item(), **stats})
                with self.timed(TRAIN):
                    skipped_before = self.engine.skipped_steps
                    grad_norm = self.engine.step()
                self._count_skip(self.engine.skipped_steps > skipped_before)
                self.record_train({"grad_norm": grad_norm, "lr": self.engine.lr})

    def forward_first(self, rollout: RolloutBatch, forward: Callable[[torch.Tensor], Any],
                      agg: str) -> FirstForward:
        """Draw the update's first pass of mini-batches (``_mini_batches``) and run ``forward``
        (rows -> output, its graph kept) on its first micro-batch, before the update: the
        update then takes both (``ppo_update``'s ``first``) where it would have drawn and run
        them, the same operations in the same order, so the step is the same to the bit. Run
        while the driver waits for what the loss needs and the forward does not (a slow
        reward's scores), it takes that forward off the step. Its memory is the update's own:
        one micro-batch's activations, held from here to that micro-batch's backward."""
        minis = self._mini_batches(rollout, agg)
        with self.timed(TRAIN):
            return FirstForward(minis, forward(minis[0][0][0].rows))

    def _count_skip(self, skipped: bool) -> None:
        self._skipped += skipped
        self._applied += not skipped
        self._skip_run = self._skip_run + 1 if skipped else 0
        self._longest_skip_run = max(self._longest_skip_run, self._skip_run)

    def export(self, directory: str) -> None:
        """The model in Hugging Face format with the actor's tokenizer under ``directory``
        (``models.export_hf``): every rank gathers, rank 0 writes."""
        with self.on_device():
            state = self.engine.full_state_dict()
        if self.rank == 0:
            tokenizer = (data.actor_tokenizer(self.cfg)
                         if data.tokenizer_dir(self.cfg) is not None else None)
            models.export_hf(self.engine.module, {k: v.cpu() for k, v in state.items()},
                             directory, tokenizer, self.model_cfg.lora.merge_on_export)
        dist.barrier()

    def _mini_batches(self, rollout: RolloutBatch, agg: str
                      ) -> list[tuple[list[batching.MicroBatch], float]]:
        """This rank's shuffled mini-batches (when the driver deals, ``Config.deals_rollouts``,
        consecutive slices of the rows in the order it dealt them, [Note: balanced ranks]; else
        a random draw of rows), each as its micro-batches and their divisor: the global
        mini-batch's count under ``agg`` (valid tokens or sequences, summed over ranks) /
        (ranks x micro-batches per step). Under ``max_tokens_per_micro_batch`` the micro-batch
        count is the largest over ranks, fillers making up the rest
        ([Note: micro-batches by tokens])."""
        size = self.cfg.ppo.mini_batch_size // self.num_ranks
        mask = rollout.action_mask
        if self.cfg.deals_rollouts:  # the driver's order: consecutive slices, shuffled
            slices = batching.split_by_rows(torch.arange(mask.shape[0]), size)
            minis = [slices[i] for i in torch.randperm(len(slices)).tolist()]
        else:
            minis = batching.split_by_rows(torch.randperm(mask.shape[0]), size)
        local = torch.tensor([core.agg_count(mask[m], agg) for m in minis], dtype=torch.float64)
        total = self.all_reduce_sum(local)
        budget = self.model_cfg.max_tokens_per_micro_batch
        num_tokens = rollout.num_tokens()
        if budget is None:
            splits = [batching.split_by_rows(m, self.model_cfg.micro_batch_size) for m in minis]
            counts = [len(s) for s in splits]  # the same on every rank: as many rows each
        else:
            try:
                splits = [batching.split_by_tokens(m, num_tokens, budget) for m in minis]
            except ValueError as err:
                raise ConfigError(f"{self.role}.max_tokens_per_micro_batch", str(err)) from None
            counts = self.all_reduce_max(torch.tensor([len(s) for s in splits])).tolist()
        return [(batching.fill_to(split, k, num_tokens),
                 batching.micro_divisor(float(t), self.num_ranks, k))
                for split, k, t in zip(splits, counts, total)]


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity, which a container or taskset may
    narrow below the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def phase_threads(cfg: Any, role: str, cores: int | None = None) -> dict[str, int]:
    """Torch threads of a CPU worker of ``role`` in each of its phases (``cluster.cpu_threads``).

    Colocated models share each device, and a device owns ``cores`` / (every device of the
    run) cores (``cores``: this process's, ``available_cores``). In each phase, the models that
    compute at once split their device's cores: the actor generates and syncs alone; the
    experience's forwards (the actor's old log-probs, the reference's, the critic's values, a
    reward model's scores) run together, and so do the actor's and critic's updates; a rollout
    replica (role ``rollout``) generates and takes the weights alone on a device of its own. Never
    more threads than cores, so no phase oversubscribes a device (a spinning OpenMP team that
    waits for a core it shares measured 10x slower forwards).
    """
    fixed = cfg.cluster.cpu_threads
    phases = ROLE_PHASES.get(role, (GENERATE, SYNC))  # else a rollout replica's
    if fixed is not None:
        return dict.fromkeys(phases, fixed)
    at_once = {GENERATE: 1, SYNC: 1, TRAIN: len(algorithms.trained_roles(cfg)),
               INFERENCE: sum(cfg.model(r).runs_model for r in algorithms.roles(cfg))}
    devices = cfg.cluster.num_devices + cfg.rollout.num_devices
    per_device = max(1, (available_cores() if cores is None else cores) // devices)
    return {phase: max(1, per_device // at_once[phase]) for phase in phases}


def engine_options(cfg: Any, role: str, trained: bool,
                   device: torch.device | str | None = None) -> EngineOptions:
    """The engine options of ``role`` from its config section
    (docs/design.md, "The engine contract"): a trained model's carry its optimizer, clipping,
    accumulation and reduction precision; a frozen model's keep their defaults."""
    model_cfg = cfg.model(role)
    ds = model_cfg.deepspeed
    training: dict[str, Any] = {}
    if trained:
        optim = model_cfg.optim
        training = dict(optim=optim.adamw(), max_grad_norm=optim.max_grad_norm,
                        grad_accum_steps=cfg.grad_accum_steps(role),
                        reduce_dtype=model_cfg.reduce_dtype)
    return EngineOptions(backend=model_cfg.backend, model_name=role, frozen=not trained,
                         precision=model_cfg.precision, device=device,
                         strategy=model_cfg.strategy, comm=cfg.comm.algorithm,
                         offload=model_cfg.offload, zero_stage=ds.zero_stage,
                         hpz_partition_size=ds.hpz_partition_size,
                         offload_optimizer=ds.offload_optimizer, deepspeed_config=ds.config,
                         **training)


def bind_gloo(node_address: str) -> None:
    """Make gloo bind to the interface that holds ``node_address`` (the address Ray knows this
    node by, which rank 0 also hands out as the rendezvous), unless GLOO_SOCKET_IFNAME already
    names one.

    Left alone, gloo binds to the address the hostname resolves to and tells its peers to connect
    there; that is loopback on many machines (an /etc/hosts line ``127.0.1.1 host``) and in a
    network namespace, so ranks on other nodes would connect to their own loopback.
    """
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    name = interface_of(node_address)
    if name is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = name


def interface_of(address: str) -> str | None:
    """The name of this machine's network interface that holds ``address``, or None."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == address for a in addresses):
            return name
    return None


def peak_bytes(device: torch.device) -> int:
    """Process peak memory: CUDA max allocated on GPU, peak resident set size on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    # Linux reports ru_maxrss in KiB.
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
