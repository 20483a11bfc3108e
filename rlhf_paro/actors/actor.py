"""The policy: generates rollouts, turns them into advantages, trains on them.

What a rank generates stays on that rank: its rollout, old log-probs and experience live here
between calls, and only what another model needs leaves (the rollout to the three models
colocated with this rank, the returns to the critic, a few sums to the driver). Generation goes
through the rollout engine ``rollout.engine`` names (``rlhf_paro/rollout``), of whose details
the actor knows nothing.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from rlhf_paro import models, rollout
from rlhf_paro.usercode import FLOAT32_MAX
from rlhf_paro.actors.rollout import Generation
from rlhf_paro.actors.worker import TrainedWorker, Worker
from rlhf_paro.comm.meter import BASE_SYNC, BASE_TRANSFER, GENERATE, SYNC, TRANSFER
from rlhf_paro.comm.transfer import TransferGroup
from rlhf_paro.metrics import INFERENCE, Sums
from rlhf_paro.ppo import algorithms, core
from rlhf_paro.ppo.data import rollout_tokenizer
from rlhf_paro.ppo.rewards import RewardFunctionError
from rlhf_paro.rollout import PromptBatch, RolloutBatch


class ActorWorker(TrainedWorker):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.tokenizer = rollout_tokenizer(self.cfg)  # its pad and eos ids
        # Built with the model, on its engine, when the rollout lives in this rank
        # (rollout.num_devices=0); None when replicas of their own generate.
        self.generation: Generation | None = None
        # Where this rank sends its weights to the replicas it serves (rollout.num_devices > 0).
        self.transfer: TransferGroup | None = None
        # Whether the weights changed since the rollout engine last took them (an engine with a
        # copy of its own: ``Rollout.needs_sync``): at setup, after an update or a resume.
        self._engine_stale = True
        # What each sync sends an engine with a copy of its own (``rollout.lora_sync``): the
        # whole model, or a LoRA actor's adapters over base weights sent once.
        self._sync_part = rollout.lora_sync(self.cfg)[0]
        # Whether this rank's engine lacks the base weights (at setup, after a resume).
        self._base_stale = True

    def shard_model(self) -> None:
        """``Worker.shard_model``, then the rollout engine ``rollout.engine`` names on this
        rank's engine, unless the rollout has devices of its own."""
        super().shard_model()
        if self.cfg.rollout.num_devices == 0:
            # Built on torch's streams of its own: vLLM's worker seeds the process's generators
            # as it starts (set_random_seed), which would replace the rank's stream that
            # Worker.shard_model has just seeded, and with it the update's mini-batch shuffles.
            # The rank shuffles alike whether its rollout lives here or on replicas of its own.
            cuda = [self.device] if self.device.type == "cuda" else []
            with torch.random.fork_rng(devices=cuda):
                engine = rollout.build(self.cfg.rollout.engine, rollout.EngineContext(
                    self.cfg, self.engine, self.tokenizer.pad_token_id,
                    self.tokenizer.eos_token_id, self.device))
            engine.sleep()  # its memory is training's until the first generation
            self.generation = Generation(self.cfg, engine, self.tokenizer, self.device)

    @property
    def rollout_engine(self) -> rollout.Rollout:
        """The engine this rank generates with (rollout.num_devices=0)."""
        return self.generation.engine

    # -- rollout replicas on devices of their own (rollout.num_devices > 0) -------------------
    def _weights(self, part: str) -> Any:
        """The actor's weights as a sync sends them (``models.hf_weights``' ``part``), a unit at
        a time: a LoRA actor's base ones gathered under ``base_sync``, its adapters from the
        trainable buffers alone, the rest under ``sync``."""
        lora = self.model_cfg.lora
        phase = BASE_SYNC if part == models.BASE else SYNC
        named = self.engine.unit_parameters(phase, trainable_only=part == models.ADAPTERS)
        return models.hf_weights(self.engine.module, named, lora.alpha / lora.r, part)

    def _parts(self, base: bool) -> list[str]:
        """What one sync sends, in order; ``base``: the engine lacks the base weights."""
        if self._sync_part == models.MERGED:
            return [models.MERGED]
        return [models.BASE, models.ADAPTERS] if base else [models.ADAPTERS]

    def weight_manifest(self) -> dict[str, list[tuple[str, tuple[int, ...], str]]]:
        """By what a sync sends (``models.MERGED``, or ``BASE`` and ``ADAPTERS``): (Hugging Face
        name, shape, dtype) of every weight a replica takes, in the order ``send_weights``
        sends them (one pass of the sync's gathers, on every rank)."""
        lora = self.model_cfg.lora
        parts = self._parts(base=True)
        phase = BASE_SYNC if models.BASE in parts else SYNC
        shapes = [(name, t.to("meta")) for name, t in self.engine.unit_parameters(phase)]
        return {part: [(name, tuple(t.shape), str(t.dtype).removeprefix("torch."))
                       for name, t in models.hf_weights(self.engine.module, shapes,
                                                        lora.alpha / lora.r, part)]
                for part in parts}

    def join_transfer(self, host: str, port: int, same_node: list[bool]) -> None:
        """The transfer group of this rank and the replicas it serves (``comm/transfer.py``);
        ``same_node``: whether each of them is on this rank's node."""
        self.transfer = TransferGroup(host, port, f"transfer{self.rank}/", 0,
                                      len(same_node) + 1, self.device, self.engine.meter,
                                      same_node)

    def send_weights(self, base: bool = False) -> None:
        """The weights to the replicas: every rank gathers each unit at the P scope (phase
        ``sync``, [Note: a unit at a time]) and a rank that serves replicas sends them each
        weight (phase ``transfer``). A LoRA actor whose replicas take adapters sends those
        alone, after the base weights (phases ``base_sync``, ``base_transfer``) where ``base``:
        the replicas' first sync."""
        with self.timed(SYNC):
            for part in self._parts(base):
                phase = BASE_TRANSFER if part == models.BASE else TRANSFER
                for _, tensor in self._weights(part):
                    if self.transfer is not None:
                        self.transfer.broadcast(tensor.contiguous(), phase)

    def load_checkpoint(self, directory: str) -> None:
        super().load_checkpoint(directory)
        self._engine_stale = self._base_stale = True

    def sync_engine(self) -> None:
        """The actor's weights into a rollout engine that holds its own copy, a unit at a time
        at the actor's P scope (phase ``sync``, [Note: a unit at a time]): the whole model, or
        a LoRA actor's adapters, after its base weights where the engine lacks them (phase
        ``base_sync``); nothing for one that reads the actor's parameters, or when they have
        not changed since the last sync."""
        if not (self.rollout_engine.needs_sync and self._engine_stale):
            return
        engine = self.rollout_engine
        with self.timed(SYNC):
            for part in self._parts(self._base_stale):
                load = engine.sync_adapters if part == models.ADAPTERS else engine.sync
                load(self._weights(part))
        self._engine_stale = self._base_stale = False

    @torch.no_grad()
    def generate(self, prompts: PromptBatch, rows: dict[str, Any] | None = None,
                 greedy: bool = False, step: int = 0) -> tuple[RolloutBatch, Sums]:
        """Sample one response per prompt (``prompts``: left-padded, ``runs.Prompts``), or, with
        an environment, one episode per prompt (``rows``: the prompts' texts and columns, which
        build the environments): ``Generation``, on this rank's prompt slice. ``greedy``: an
        evaluation, whose rollout is returned and not kept. Returns the rollout (for the other
        models of this rank) and sums for the driver."""
        self.rollout_engine.wake()
        self.sync_engine()
        with self.timed(GENERATE):
            batch, stats = self.generation(prompts, rows, greedy, step, self.rank)
        self.rollout_engine.sleep()
        # The positions the engine computed on: every position of the rows for a static batch,
        # the real tokens for one that computes no padding (``Rollout.computes_padding``).
        self.count_tokens(batch.attention_mask,
                          packed=not self.rollout_engine.computes_padding)
        return batch, stats

    # -- the calls of a step's plan (ppo/step.py): each reads named values, gives a dict ------
    @torch.no_grad()
    def old_logprobs(self, step: int, rollout: RolloutBatch) -> dict[str, Any]:
        """``old_logp``: log-probs of this rank's ``rollout`` under the policy that sampled it;
        ``mismatch``: how far the engine's own log-probs are from them (``mismatch``)."""
        with self.timed(INFERENCE):
            old_logp = self.in_micro_batches(rollout, lambda rows: logprobs(self, rows))
        return {"old_logp": old_logp, "mismatch": mismatch(rollout, old_logp)}

    @torch.no_grad()
    def make_experience(self, step: int, rollout: RolloutBatch, scores: torch.Tensor,
                        kl_coef: float, old_logp: torch.Tensor | None = None,
                        ref_logp: torch.Tensor | None = None, values: torch.Tensor | None = None
                        ) -> dict[str, Any]:
        """This rank's ``experience`` (``core.make_experience``: token rewards, the KL penalty
        in them unless ``algorithm.kl_in_loss``, the run's advantage estimator), the critic's
        ``targets`` (with a critic's ``values``) and ``exp_sums`` for the driver.

        ``old_logp``: None where the update gives them; ``ref_logp``: None in a run without a
        reference; ``values``: None without a critic. A rank's rollout holds whole groups of
        ``rollout.n`` samples (``runs.Prompts.next``), so group baselines need nothing from
        other ranks; batch-wide normalisations sum their moments over ranks. Scores too large
        for the step's float32 arithmetic are a ``RewardFunctionError`` naming their source and
        ``step`` (``check_experience``).
        """
        ppo, alg = self.cfg.ppo, self.cfg.algorithm
        mask = rollout.action_mask
        groups = torch.arange(len(mask)).div(self.cfg.rollout.n, rounding_mode="floor")
        spec = core.ExperienceSpec(alg.adv_estimator, alg.kl_estimator, alg.kl_in_loss,
                                   ppo.gamma, ppo.lam, ppo.whiten_advantages)
        exp = core.make_experience(spec, old_logp, ref_logp, scores, mask, groups, values,
                                   kl_coef, self.all_reduce_sum)
        check_experience(exp, scores, mask, reward_source(self.cfg), step)
        sums = {"count": float(mask.shape[0]), "tokens": float(mask.sum()),
                "reward": float(scores.sum()), "kl": float(exp.kl.sum()),
                "advantage": float((exp.advantages * mask).sum()),
                "return": float((exp.returns * mask).sum())}
        given = {"experience": exp, "exp_sums": Sums(total=sums)}
        if values is not None:  # a critic's: its targets
            given["targets"] = exp.returns
        return given

    def forward_ahead(self, step: int, rollout: RolloutBatch) -> dict[str, Any]:
        """``first_forward``: the update's first forward (``TrainedWorker.forward_first``),
        ahead of the scores. The plan issues it once what must be computed first is there (the
        reference's log-probs, the critic's values), so it runs alone on the device while a
        reward that runs no model (a function, a server, an environment's score) is still
        waited for."""
        return {"first_forward": self.forward_first(
            rollout, lambda idx: logprobs(self, rollout.select(idx), train=True),
            algorithms.loss_agg_mode(self.cfg))}

    def train(self, step: int, rollout: RolloutBatch, experience: core.Experience,
              kl_coef: float, first_forward: Any = None) -> dict[str, Any]:
        """The policy update of step ``step`` on this rank's rollout: the clipped surrogate,
        aggregated as the algorithm says, plus ``kl_coef`` times the KL loss term when
        ``algorithm.kl_in_loss``; ``first_forward``: its first forward, run ahead.

        Without old log-probs in ``experience`` (``algorithms.old_logprobs_from_update``), each
        micro-batch's forward gives its rows' before the only optimizer step; then it gives
        what ``old_logprobs`` would have: the engine's distance (``mismatch``) and, in
        ``update_sums``, the KL sum (zero without a reference). ``update_sums`` holds the
        sums of ``rollout.mask`` too (``mask_sums``); without either it is empty."""
        batch, ppo, alg = rollout, self.cfg.ppo, self.cfg.algorithm
        anchored = experience.old_logp is None
        if anchored and len(batch) > ppo.mini_batch_size // self.num_ranks:
            raise RuntimeError("old log-probs from the update need one mini-batch a step")
        anchor = torch.zeros(batch.action_mask.shape)
        covered = torch.zeros(len(batch), dtype=torch.bool)
        tis_cap = self.cfg.rollout.tis_cap  # every engine gives log-probs of a sampled rollout
        level = self.cfg.rollout.mask
        band = self.cfg.rollout.mask_band if level is not None else None
        # Each row's mask statistic, kept by row (not per call) so that a filler micro-batch
        # or a second epoch, which see a row again, count it once.
        log_ratios = torch.zeros(len(batch), dtype=torch.float64)
        agg = algorithms.loss_agg_mode(self.cfg)
        # Dr. GRPO divides each sequence's token sum by the response budget, a constant.
        norm = (ppo.max_new_tokens if algorithms.spec(self.cfg).token_sum_norm
                and agg == "seq_mean_token_sum" else None)

        def micro_loss(idx: torch.Tensor, divisor: float, ahead: Any
                       ) -> tuple[torch.Tensor, dict]:
            rows, exp = batch.select(idx), experience.select(idx)
            mask = rows.action_mask.to(self.device)
            logp = ahead if ahead is not None else logprobs(self, rows, train=True)
            if anchored:  # before any optimizer step: the policy that the rollout trains
                old_logp = logp.detach()
                anchor[idx], covered[idx] = old_logp.float().cpu(), True
            else:
                old_logp = exp.old_logp.to(self.device)
            # The engine sampled, the trainer's old log-probs anchor the ratio: reweight to them.
            weights = None
            if tis_cap is not None or level is not None:
                behaviour = rows.logprobs.to(self.device)
            if tis_cap is not None:
                weights = core.tis_weights(old_logp, behaviour, tis_cap)
                # The share of action tokens whose weight the cap cut.
                capped = ((old_logp - behaviour) >= math.log(tis_cap)).float()
                clipped = float((capped * mask).sum() / mask.sum().clamp(min=1))
            if level is not None:
                # A sample outside the band weighs 0: its tokens still count in the divisor,
                # fixed before the forward (TRL's choice; docs/design.md, "Rollout"), so a
                # step that masks more moves the policy less.
                log_ratio = core.mask_log_ratio(old_logp, behaviour, mask, level)
                log_ratios[idx] = log_ratio.cpu()
                keep = core.in_band(log_ratio, *band).to(old_logp.dtype)[:, None].expand_as(mask)
                weights = keep if weights is None else weights * keep
            loss, stats = core.policy_loss(
                logp, old_logp, exp.advantages.to(self.device), mask,
                ppo.clip_eps, divisor, agg=agg, token_sum_norm=norm, weights=weights)
            metrics = {"actor/clipfrac": stats["clipfrac"], "approx_kl": stats["approx_kl"]}
            if tis_cap is not None:
                metrics["rollout/tis_clipfrac"] = clipped
            if exp.ref_logp is not None:
                kl_loss, kl_stats = core.kl_loss(logp, exp.ref_logp.to(self.device), mask,
                                                 alg.kl_estimator, agg, divisor, norm)
                loss = loss + kl_coef * kl_loss
                metrics["actor/kl_loss"] = kl_stats["kl"]
            return loss, metrics

        self.ppo_update(batch, micro_loss, step, agg, first_forward)
        self._engine_stale = True
        masked = Sums() if band is None else mask_sums(log_ratios, *band)
        if not anchored:
            return {"update_sums": masked}
        assert bool(covered.all()), "a row of the rollout had no training forward"
        ref_logp, mask = experience.ref_logp, batch.action_mask
        kl = (0.0 if ref_logp is None else
              float((core.kl_estimate(anchor, ref_logp, alg.kl_estimator) * mask).sum()))
        return {"update_sums": Sums.fold([Sums(total={"kl": kl}), masked]),
                "mismatch": mismatch(batch, anchor)}


def mask_sums(log_ratio: torch.Tensor, low: float, high: float) -> Sums:
    """What a rank's samples (``log_ratio``: each one's ``core.mask_log_ratio``) say of the
    mask's band [``low``, ``high``]: how many it masked, above and below it, out of how many,
    and the statistic's sum, least and most; folded over ranks into ``rollout/masked_fraction``
    and the rest (``metrics.engine_mask``)."""
    kept = core.in_band(log_ratio, low, high)
    return Sums(total={"mask_samples": float(len(log_ratio)),
                       "mask_masked": float((~kept).sum()),
                       "mask_masked_high": float((log_ratio > math.log(high)).sum()),
                       "mask_masked_low": float((log_ratio < math.log(low)).sum()),
                       "mask_log_ratio_sum": float(log_ratio.sum())},
                least={"mask_log_ratio": float(log_ratio.min())},
                most={"mask_log_ratio": float(log_ratio.max())})


def mismatch(rollout: RolloutBatch, old_logp: torch.Tensor) -> Sums | None:
    """How far the engine's log-probs of ``rollout`` are from the trainer's ``old_logp`` over the
    real response tokens: the largest |difference| (``most``), their sum and count (``total``),
    folded into ``rollout/logprob_diff_*`` (``metrics.logprob_diff``); None when the engine gave
    none."""
    if rollout.logprobs is None:
        return None
    diff = (old_logp.cpu() - rollout.logprobs)[rollout.action_mask.bool()].abs()
    return Sums(total={"logprob_diff_sum": float(diff.sum()),
                       "logprob_diff_count": float(len(diff))},
                most={"logprob_diff": float(diff.max()) if len(diff) else 0.0})


def reward_source(cfg: Any) -> str:
    """What gave a run's scores, as its error lines name it."""
    reward = cfg.reward
    if reward.function is not None:
        return f"reward function {reward.function}"
    if reward.url is not None:
        return f"reward server {reward.url}"
    if reward.env_score:
        return f"environment {cfg.env.function}"
    return f"reward model {reward.path or 'reward.config'}"


def check_experience(exp: core.Experience, score: torch.Tensor, mask: torch.Tensor,
                     source: str, step: int | None) -> None:
    """``RewardFunctionError`` naming ``source`` and ``step`` when scores that float32 holds one
    by one (``usercode.finite32``, checked where they were read) still overflow the step's
    arithmetic: a group's sum or squares (GRPO's mean and std), the returns' squares (the
    critic's loss sums them over a micro-batch). The update would skip step after step on a
    non-finite loss, and the skipped-step stop could only name the model. The bound is the
    step's own: each tensor's squares, summed in float64 over the rank's tokens, fit float32,
    which bounds every sum of squares a loss takes over a part of them."""
    for name, tensor in (("advantages", exp.advantages), ("returns", exp.returns)):
        kept = tensor[mask.bool()].double()
        if bool(torch.isfinite(kept).all()) and float(kept.square().sum()) <= FLOAT32_MAX:
            continue
        where = source + (f" at step {step}" if step is not None else "")
        raise RewardFunctionError(
            f"{where}: the scores (largest |x| {float(score.abs().max()):.4g}) overflow "
            f"float32 in the step's {name}; allowed: scores whose squares, summed over a "
            f"step's samples, stay within float32's range ({FLOAT32_MAX:.4g})")


def logprobs(worker: Worker, rows: RolloutBatch, train: bool = False) -> torch.Tensor:
    """(B, T) log-probs of the response tokens of ``rows`` under ``worker``'s causal LM, at the
    sampling temperature (so the rollout's log-probs are those of the policy that sampled it)."""
    return worker.forward(rows, train=train, response_len=rows.response_len,
                          temperature=worker.cfg.ppo.temperature)
