"""Generation: what samples a rollout, in an actor rank's process or on a rollout replica.

``Generation`` is the one place a rank's rollout is sampled: its engine (``rollout.engine``), the
environments of multi-turn episodes, the random stream of each step (``rollout.generation_seed``:
the same rollout from any process that generates the same prompt slice at the same step). The
actor holds one when the engines live in its ranks (``rollout.num_devices=0``); with
``rollout.num_devices=D`` a ``RolloutWorker`` holds one on each of D devices of its own, with a
copy of the actor's weights that the actor sends after each update (``comm/transfer.py``;
docs/design.md, "Asynchronous rollouts").
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import torch

from rlhf_paro import envs, models, rollout
from rlhf_paro.actors.worker import Worker, bind_gloo, set_num_threads
from rlhf_paro.comm.transfer import TransferGroup
from rlhf_paro.metrics import GENERATE, Sums
from rlhf_paro.ppo.data import rollout_tokenizer, vocab_sizes
from rlhf_paro.rollout import PromptBatch, RolloutBatch, episodes
from rlhf_paro.rollout.hf import HFReplica, LocalWeights, static_decode


class Generation:
    """Samples a prompt slice's rollout with ``engine``: one response per prompt, or, with an
    environment, one episode per prompt."""

    def __init__(self, cfg: Any, engine: rollout.Rollout, tokenizer: Any,
                 device: torch.device) -> None:
        self.cfg = cfg
        self.engine = engine
        self.tokenizer = tokenizer  # its pad and eos ids, and an episode's text
        self.device = device
        # Episodes each their own loop, each sample its own seeded stream (a single-turn
        # response an episode's first action): rollout.streaming (auto: the engine's own
        # choice) on an engine that takes requests.
        self._streams = engine.takes_requests and cfg.rollout.streams(engine.streams_by_default)
        # Multi-turn episodes (env.function, env.tools): the environments' runner and what
        # turns their observations into tokens; None for single-turn rollouts.
        self.env_runner: envs.EnvRunner | None = None
        self.observations: envs.Observations | None = None
        if cfg.env.enabled:
            factory, name = envs.load(cfg)
            self.env_runner = envs.EnvRunner(factory, name, cfg.env.num_workers,
                                             cfg.env.timeout_s)
            self.observations = envs.Observations(
                tokenizer, cfg.data.apply_chat_template, envs.tool_schemas(cfg),
                cfg.env.observation_special_tokens)

    @torch.no_grad()
    def __call__(self, prompts: PromptBatch, rows: dict[str, Any] | None, greedy: bool,
                 step: int, shard: int) -> tuple[RolloutBatch, Sums]:
        """The rollout of prompt slice ``shard`` at step ``step`` (``prompts``: left-padded,
        ``runs.Prompts``; ``rows``: their texts and columns, which build the environments), and
        sums for the driver (an environment's as their ``env``, ``episodes.run``). With an
        engine that takes requests and ``rollout.streaming``, each episode is a loop of its own
        (``episodes.stream``), and each sample draws from a stream of its own.
        ``greedy``: an evaluation. Sampled from the slice's own random stream."""
        cfg = self.cfg
        sampling = rollout.Sampling.from_config(cfg.ppo, greedy)
        env_stats: Sums | None = None
        with rollout.seeded(rollout.generation_seed(cfg.trainer.seed, step, shard), self.device):
            if self.env_runner is None and self._streams and not greedy:
                # Each response from a stream of its own: an episode's first action's.
                seeds = self._seeds(len(prompts), greedy, step, shard)
                batch = self.engine.generate(prompts, sampling,
                                             [episodes.action_seed(s, 0) for s in seeds])
            elif self.env_runner is None:
                batch = self.engine.generate(prompts, sampling)
            else:
                batch, env_stats = self._episodes(prompts, rows, sampling, step, shard)
        stats = Sums(total={"count": float(len(batch)),
                            "response_length": float(batch.action_mask.sum()),
                            "real_tokens": float(batch.attention_mask.sum())}, env=env_stats)
        return batch, stats

    def _episodes(self, prompts: PromptBatch, rows: dict[str, Any], sampling: rollout.Sampling,
                  step: int, shard: int) -> tuple[RolloutBatch, Sums]:
        """The slice's episodes (``episodes.run``): sample i of the step is number
        shard x len(prompts) + i, which names it in error lines and seeds its environment (an
        evaluation's seeds are apart from the training steps')."""
        cfg = self.cfg
        first = shard * len(prompts)
        key = cfg.data.prompt_key
        samples = [{key: text, **{c: values[i] for c, values in rows["columns"].items()}}
                   for i, text in enumerate(rows["texts"])]
        seeds = self._seeds(len(prompts), sampling.greedy, step, shard)
        what = "evaluation after step" if sampling.greedy else "step"
        args = (prompts, samples, seeds, self.env_runner, self.observations,
                lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True), sampling,
                episodes.Budget(cfg.env.max_turns, cfg.env.max_total_tokens),
                self.tokenizer.pad_token_id, lambda i: f"at {what} {step}, sample {first + i}")
        if self._streams:
            # Each episode's actions sample from its own stream, seeded as its environment is.
            return episodes.stream(self.engine, *args, sample_seeds=seeds)
        return episodes.run(self.engine, *args)

    def _seeds(self, count: int, greedy: bool, step: int, shard: int) -> list[int]:
        """The seeds of the slice's samples (``envs.sample_seed``): sample i of the step is
        number shard x count + i; an evaluation's are apart from the training steps'."""
        stream = -1 - step if greedy else step
        return [envs.sample_seed(self.cfg.trainer.seed, stream, shard * count + i)
                for i in range(count)]


class RolloutWorker(Worker):
    """Replica ``rank`` of the rollout on a device of its own: an engine with its own copy of
    the actor's weights (``receive_weights`` after each update), sampling the prompt slices the
    driver gives it (``generate``)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.tokenizer = rollout_tokenizer(self.cfg)
        self.generation: Generation | None = None  # built at setup
        self.transfer: TransferGroup | None = None  # its actor rank and it (setup)
        # (Hugging Face name, shape, dtype) of every weight, in the order the actor sends them,
        # by what a sync sends (``ActorWorker.weight_manifest``).
        self.manifest: dict[str, list[tuple[str, tuple[int, ...], str]]] = {}
        self.received_bytes = 0  # the last sync's, for the next generation's sums
        self.sync_s = 0.0  # the last sync's seconds, likewise

    def setup(self, host: str, port: int, source: int, group_rank: int, group_size: int,
              manifest: dict[str, list[tuple[str, tuple[int, ...], str]]]) -> int:
        """Join the transfer group of actor rank ``source`` (as ``group_rank`` of
        ``group_size``) and build the engine; returns this worker's process id."""
        if self.device.type == "cpu":
            bind_gloo(__import__("ray").util.get_node_ip_address())
        # A replica owns its device alone: it generates as the actor does alone on its own.
        if self.device.type == "cpu":
            set_num_threads(self._threads[GENERATE])
        self.transfer = TransferGroup(host, port, f"transfer{source}/", group_rank, group_size,
                                      self.device)
        self.manifest = manifest
        cfg = self.cfg
        actor = cfg.actor
        hf_config = models.hf_config("actor", actor, vocab_sizes(cfg)["actor"])
        pad, eos = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        if cfg.rollout.engine == "hf":
            # The plain model: a LoRA actor sends its weights merged, or its adapters, which the
            # replica merges into it (models.hf_weights).
            plain = dataclasses.replace(actor, lora=dataclasses.replace(actor.lora, enabled=False))
            module = models.build_model("actor", plain, vocab_sizes(cfg)["actor"],
                                        seed=cfg.trainer.seed).to(self.device)
            module.eval()
            engine: rollout.Rollout = HFReplica(
                LocalWeights(module), pad, eos, self.device, cfg.rollout.micro_batch_size,
                static_decode(cfg, module.lm, self.device),
                lora_scale=actor.lora.alpha / actor.lora.r)
        else:
            from rlhf_paro.rollout.vllm import VLLMRollout

            engine = VLLMRollout(cfg, hf_config, eos, pad, self.device,
                                 seed=cfg.trainer.seed * 1000 + 500 + self.rank)
        self.generation = Generation(cfg, engine, self.tokenizer, self.device)
        return os.getpid()

    def receive_weights(self, base: bool = False) -> None:
        """The actor's weights, as its rank sends them (``ActorWorker.send_weights``), into the
        engine, one weight at a time (phase ``sync``): the whole model, or a LoRA actor's
        adapters, after its base weights where ``base`` (the first sync)."""
        engine = self.generation.engine

        def stream(part: str) -> Any:
            for name, shape, dtype in self.manifest[part]:
                tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
                self.transfer.broadcast(tensor)
                self.received_bytes += tensor.numel() * tensor.element_size()
                yield name, tensor

        engine.wake()
        self.received_bytes = 0
        start = time.perf_counter()
        if models.MERGED in self.manifest:
            engine.sync(stream(models.MERGED))
        else:
            if base:
                engine.sync(stream(models.BASE))
            engine.sync_adapters(stream(models.ADAPTERS))
        self.sync_s = time.perf_counter() - start

    def generate(self, prompts: PromptBatch, rows: dict[str, Any] | None = None,
                 greedy: bool = False, step: int = 0) -> tuple[RolloutBatch, Sums]:
        """This replica's prompt slice of step ``step`` (``Generation``), and sums for the
        driver, with this replica's seconds generating it and taking the weights it was
        generated with, and their bytes (``replica_*``: the replicas report nothing else, so
        that no call waits behind a generation that runs ahead)."""
        start = time.perf_counter()
        with self.threads(GENERATE):  # the count vLLM's binding set is not the phase's
            batch, stats = self.generation(prompts, rows, greedy, step, self.rank)
        stats.total.update(replica_generate_s=time.perf_counter() - start,
                           replica_sync_s=self.sync_s,
                           replica_received_bytes=float(self.received_bytes))
        self.sync_s, self.received_bytes = 0.0, 0
        return batch, stats
