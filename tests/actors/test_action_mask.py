"""The action mask keeps a multi-turn episode's observations out of training (docs/design.md,
"Multi-turn episodes"): on 2 gloo ranks, each rank runs the trainer's own plan of a step
(``ppo/step.py``) on its rank of the real workers (no Ray; the reward and the reference give the
test's scores and log-probs), which make the experience of a fixed rollout of episodes
(``episodes.assemble``: mixed prompt lengths, several observations between the actions of a
row) and train on it, for every advantage estimator and loss aggregation, the KL in the reward
and in the loss, padded (``packing=false``, 2 rows a micro-batch) and packed (micro-batches of
``max_tokens_per_micro_batch`` real tokens, fillers on the rank that needs fewer).

Which tokens are actions and which observations comes from ``EPISODES`` itself, never from the
rollout's ``action_mask``. Against it every real micro-batch of each update must show:

- gradient exactly 0 at every logit that predicts an observation token (actor) and at every
  value of an observation column (critic): a masked term is multiplied by 0, so not even
  rounding may leave anything there. Every position that predicts an action token does get a
  gradient (the hooks see the backward), and no other position does;
- the loss's divisor is the global mini-batch's count of action tokens (``token_mean``) or of
  sequences (the ``seq_*`` modes) / (ranks x micro-batches agreed), the mask each aggregation
  reads is the actions', and the loss the worker records is the aggregate of its per-token
  terms over the action tokens alone, computed here;
- the experience (KL, advantages, returns) is 0 on observations, and a packed micro-batch
  stays within its token budget counting observations too (they cost compute).

The same run on the rollout whose ``action_mask`` is the response's attention (observations
counted as actions: the leak the mask prevents) must fail these checks.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from rlhf_paro.ppo import algorithms, core
from tests.confs import load
from tests.dist_utils import run_distributed
from tests.steps import spy

pytestmark = [pytest.mark.dist, pytest.mark.slow]

WORLD = 2
BUDGET = 28  # real tokens per micro-batch on the packed path
KL_COEF = 0.1
MODEL = ("{model_type: llama, hidden_size: 16, intermediate_size: 32, num_hidden_layers: 1, "
         "num_attention_heads: 2, num_key_value_heads: 1, max_position_embeddings: 32}")
ESTIMATORS = ("gae", "grpo", "dr_grpo", "rloo", "reinforce_pp")
# Each rank's 8 episodes (4 groups of rollout.n = 2; 2 mini-batches of 4): a prompt length, then
# the lengths of the response's runs, an action first, then an observation and an action in
# turn (every episode ends with an action, as ``episodes.run`` leaves them). Packed, rank 0's
# long rows take 2 micro-batches in each mini-batch, rank 1's short ones 1 or 2 (1 and a
# filler): ``test_packed_micro_batches_count_every_real_token``.
EPISODES = [
    [(3, [2, 3, 1, 2, 3]), (5, [1, 2, 4]), (2, [3, 1, 2, 1, 1, 2, 2]), (4, [4]),
     (1, [2, 2, 2, 2, 2]), (6, [1, 1, 1, 3, 1]), (3, [5, 4, 1]), (2, [1, 5, 2, 1, 3])],
    [(2, [1, 1, 1]), (1, [2, 3, 1]), (3, [1, 2, 2]), (1, [1, 1, 1, 1, 1]),
     (2, [2, 1, 2]), (4, [1, 2, 1]), (1, [3, 1, 1, 1, 1]), (2, [1, 3, 2])],
]


@dataclasses.dataclass(frozen=True)
class Case:
    estimator: str
    agg: str
    kl_in_loss: bool
    packed: bool

    def __str__(self) -> str:
        return (f"{self.estimator}-{self.agg}-{'kl_loss' if self.kl_in_loss else 'kl_reward'}-"
                f"{'packed' if self.packed else 'padded'}")


CASES = [Case(*c) for c in itertools.product(ESTIMATORS, core.LOSS_AGG_MODES, (False, True),
                                             (False, True))]


def _argv(case: Case, output_dir: str) -> list[str]:
    split = ([f"{m}.max_tokens_per_micro_batch={BUDGET}" for m in ("actor", "critic")]
             if case.packed else [f"{m}.packing=false" for m in ("actor", "critic")])
    return [f"actor.config={MODEL}", "reward.path=null", "data.train_files=null",
            "cluster.num_devices=2", "cluster.group_size=2", "rollout.n=2",
            "rollout.tis_cap=2.0", f"algorithm.adv_estimator={case.estimator}",
            f"algorithm.loss_agg_mode={case.agg}", f"algorithm.kl_in_loss={case.kl_in_loss}",
            f"algorithm.kl_coef={KL_COEF}", "ppo.rollout_batch_size=8", "ppo.mini_batch_size=8",
            "ppo.ppo_epochs=1", "data.max_prompt_length=6", "ppo.max_new_tokens=6",
            "actor.micro_batch_size=2", "critic.micro_batch_size=2", "actor.optim.lr=1e-4",
            "critic.optim.lr=1e-4", "trainer.resume=none", f"trainer.output_dir={output_dir}",
            *split]


def _config(base, case: Case):
    """``case``'s config from ``base``, the gae run's of the same layout: composing a config
    takes about a second, longer than a case runs, and the cases differ in the algorithm
    section alone (``test_a_case_s_config_is_the_one_its_keys_load``)."""
    algorithm = dataclasses.replace(base.algorithm, adv_estimator=case.estimator,
                                    loss_agg_mode=case.agg, kl_in_loss=case.kl_in_loss,
                                    kl_estimator=None)
    cfg = dataclasses.replace(base, algorithm=algorithm)
    # The estimator resolve gives a null one: k1 in the reward, k3 in the loss.
    return dataclasses.replace(cfg, algorithm=dataclasses.replace(
        algorithm, kl_estimator=algorithms.kl_estimator(cfg)))


def _layout(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, R) 0/1 of rank ``rank``'s action tokens and of its observation tokens."""
    rows = EPISODES[rank]
    width = max(sum(runs) for _, runs in rows)
    actions, observations = torch.zeros(len(rows), width), torch.zeros(len(rows), width)
    for row, (_, runs) in enumerate(rows):
        at = 0
        for i, n in enumerate(runs):
            (actions if i % 2 == 0 else observations)[row, at:at + n] = 1
            at += n
    return actions, observations


# -- on the ranks ----------------------------------------------------------------------------------

def _rollout(rank: int, vocab: int, pad: int):
    """Rank ``rank``'s episodes as ``episodes.run`` leaves them, random token ids (not the pad
    or eos ids 0-2)."""
    from rlhf_paro.rollout.episodes import Episode, assemble

    gen = torch.Generator().manual_seed(rank)
    episodes = []
    for prompt_len, runs in EPISODES[rank]:
        ids = torch.randint(3, vocab, (prompt_len + sum(runs),), generator=gen).tolist()
        episode, at = Episode(ids[:prompt_len]), prompt_len
        for i, n in enumerate(runs):
            episode.add(ids[at:at + n], action=i % 2 == 0)
            at += n
        episodes.append(episode)
    return assemble(episodes, pad, greedy=True)


def _watch_output(module: torch.nn.Module, grads: list) -> None:
    """Append the gradient of the output of each training forward of ``module`` to ``grads``
    (the backward is the engine's, ``engine.backward``)."""

    def hook(_module, _args, output):
        if output.requires_grad:  # the inference forwards run without autograd
            slot: dict = {}
            grads.append(slot)
            output.register_hook(lambda g: slot.__setitem__("grad", g.detach().float().cpu()))

    module.register_forward_hook(hook)


def _record_update(worker, minis: list) -> None:
    """Record each mini-batch the worker's update runs in ``minis``: its micro-batches' rows,
    filler weights and divisors, and the ``core.aggregate`` calls of each one's loss."""
    mini_batches, ppo_update = worker._mini_batches, worker.ppo_update

    def recorded_minis(rollout, agg):
        out = mini_batches(rollout, agg)
        minis.extend([{"rows": m.rows, "weight": m.weight} for m in micros] for micros, _ in out)
        return out

    def recorded_update(rollout, micro_loss, step, agg="token_mean", first=None):
        seen: list[dict] = []  # a dict per micro-batch, in the order they run

        def loss(idx, divisor, ahead):
            aggregate, calls = core.aggregate, []

            def spy(per_token, mask, agg, divisor=None, token_sum_norm=None):
                out = aggregate(per_token, mask, agg, divisor, token_sum_norm)
                calls.append({"per_token": per_token.detach().cpu(), "mask": mask.cpu(),
                              "agg": agg, "divisor": divisor, "norm": token_sum_norm})
                return out

            core.aggregate = spy  # what policy_loss, value_loss and kl_loss call
            try:
                result = micro_loss(idx, divisor, ahead)
            finally:
                core.aggregate = aggregate
            seen.append({"divisor": divisor, "aggregates": calls})
            return result

        start = len(minis)
        ppo_update(rollout, loss, step, agg, first)
        micros = [m for mini in minis[start:] for m in mini]
        assert len(micros) == len(seen)
        for micro, extra in zip(micros, seen):
            micro.update(extra)

    worker._mini_batches, worker.ppo_update = recorded_minis, recorded_update


def _cells(grads: list, micros: list, rollout, what: str, packed: bool
           ) -> tuple[torch.Tensor, float]:
    """(B, R) the largest |gradient| at each response column over the real micro-batches
    (``what`` logits: at the logits that predict its token, the largest over the vocabulary;
    values: at its value), and the largest |gradient| at any other output position."""
    from rlhf_paro import batching

    R = rollout.response_len
    cells, other = torch.zeros(len(rollout), R), 0.0
    assert len(grads) == len(micros)
    for slot, micro in zip(grads, micros):
        grad = slot["grad"].abs()
        grad = grad.amax(-1) if what == "logits" else grad.squeeze(-1)
        if micro["weight"] == 0.0:  # a filler: its loss is times 0
            assert float(grad.max()) == 0.0
            continue
        idx = micro["rows"]
        rows = rollout.select(idx)
        # The response cell (row * R + column) each output position predicts, or -1.
        if not packed:
            # Logits: at the R + 1 last columns, the last predicting nothing
            # (models.CausalLM.forward); values: at every column, R + 1 before the end.
            start = 0 if what == "logits" else rows.sequences.shape[1] - R - 1
            target = torch.full(grad.shape, -1, dtype=torch.long)
            target[:, start:start + R] = idx[:, None] * R + torch.arange(R)
        else:
            pk = batching.pack(rows.sequences, rows.attention_mask)
            width = pk.input_ids.shape[1]
            index, row, col = batching.response_predictors(pk, R)
            target = torch.full((pk.input_ids.numel(),), -1, dtype=torch.long)
            target[pk.slots[index]] = idx[row] * R + col
            if what == "logits":  # the LM head ran at the columns where some row predicts
                target = target.view(-1, width)[:, torch.unique(pk.slots[index] % width)]
            target = target.reshape(grad.shape)
        hit = target >= 0
        cell = target[hit]  # each at most once: a row's cells are predicted once a forward
        cells.view(-1)[cell] = torch.maximum(cells.view(-1)[cell], grad[hit])
        other = max(other, float(grad[~hit].max()) if bool((~hit).any()) else 0.0)
    return cells, other


def _rank_trainer(cfg, rank: int, rollout):
    """The trainer of ``cfg`` on rank ``rank`` of this gloo group: every model's worker of that
    rank in this process (``LocalCluster``), the source giving ``rollout`` (``tests/steps.py``).
    Every rank's trainer runs the same plan, so the models' collectives meet."""
    from rlhf_paro.cluster import LocalCluster
    from rlhf_paro.trainer import PPOTrainer
    from tests.steps import FixedSource

    return PPOTrainer(cfg, cluster=LocalCluster(cfg, rank, WORLD, FixedSource(rollout)))


def _losses(worker, seen: list) -> None:
    """Keep the losses the step's update recorded in ``seen``, as the report that resets them
    reads them."""
    report = worker.report

    def reported():
        seen.extend(worker._train_stats["loss"])
        return report()

    worker.report = reported


def _one_path(rank: int, cfg, case: Case, leak: bool) -> dict:
    from rlhf_paro.metrics import Sums
    from rlhf_paro.ppo import data

    rollout = _rollout(rank, data.vocab_sizes(cfg)["actor"],
                       data.rollout_tokenizer(cfg).pad_token_id)  # the actor's pad id
    if leak:
        rollout = dataclasses.replace(rollout, action_mask=rollout.response_attention.float())
    trainer = _rank_trainer(cfg, rank, rollout)
    workers = {role: trainer.models[role].workers[0] for role in ("actor", "critic")
               if role in trainer.models}
    assert ("critic" in workers) == (case.estimator == "gae")
    grads, minis = {role: [] for role in workers}, {role: [] for role in workers}
    losses = {role: [] for role in workers}
    for role, worker in workers.items():
        assert worker.packed is case.packed
        head = (worker.engine.module.lm.get_output_embeddings() if role == "actor"
                else worker.engine.module.value_head)
        _watch_output(head, grads[role])
        _record_update(worker, minis[role])
        _losses(worker, losses[role])
    actor = workers["actor"]
    gen = torch.Generator().manual_seed(100 + rank)
    scores = torch.randn(len(rollout), generator=gen)  # distinct in each group

    # The policy's log-probs of the rollout, to make the engine's from: the step's own must
    # equal them.
    old = actor.old_logprobs(0, rollout)["old_logp"]
    # What an engine gives: log-probs near the trainer's on the actions, 0 elsewhere (they
    # weigh each token under rollout.tis_cap); a reference that differs from the policy at
    # every position, observations included.
    engine_logp = (old + 0.05 * torch.randn(old.shape, generator=gen)) * rollout.action_mask
    rollout = dataclasses.replace(rollout, logprobs=engine_logp)
    trainer.source.rollout = rollout
    ref_logp = old + 0.1 * torch.randn(old.shape, generator=gen)
    # The reward and the reference give the test's scores and log-probs, as tests/steps.py's
    # reward does.
    trainer.models["ref"].workers[0].logprobs = lambda step, rollout: {
        "ref_logp": ref_logp.clone()}
    trainer.models["reward"].workers[0].score = lambda step, rollout, rows=None: {
        "scores": scores.clone(),
        "reward_sums": Sums(total={"count": float(len(scores)),
                                   "task_score": float(scores.sum())})}
    seen: dict = {}
    for method in ("old_logprobs", "make_experience"):
        spy(actor, method, seen)
    trainer.step(0)
    assert torch.equal(seen["old_logprobs"]["old_logp"], old)

    exp = seen["make_experience"]["experience"]
    out = {"kl": exp.kl, "advantages": exp.advantages, "returns": exp.returns,
           "num_tokens": rollout.num_tokens(), "action_mask": rollout.action_mask,
           "response_attention": rollout.response_attention,
           # rollout/logprob_diff_*, over the actions
           "logprob_diff": seen["old_logprobs"]["mismatch"],
           "logprob_gap": (old - engine_logp).abs(), "roles": {}}
    for role in workers:
        micros = [m for mini in minis[role] for m in mini]
        cells, other = _cells(grads[role], micros, rollout,
                              "logits" if role == "actor" else "values", case.packed)
        out["roles"][role] = {"cells": cells, "other": other, "minis": minis[role],
                              "losses": losses[role]}
    return out


def _rank(rank: int, world_size: int, output_dir: str) -> dict:
    base = {packed: load(_argv(Case("gae", "token_mean", False, packed), output_dir))
            for packed in (False, True)}
    return {(str(case), leak): _one_path(rank, _config(base[case.packed], case), case, leak)
            for case in CASES for leak in (False, True)}


# -- the checks ------------------------------------------------------------------------------------

def _aggregate(per_token: torch.Tensor, actions: torch.Tensor, agg: str, divisor: float,
               norm: float | None) -> tuple[float, float]:
    """``core.aggregate`` written out over the action tokens, in float64, and the same sum of
    the terms' magnitudes (the scale of its float32 rounding)."""
    x, m = per_token.double(), actions.double()
    if agg == "token_mean":
        per_row, per_row_abs = (x * m).sum(-1), (x.abs() * m).sum(-1)
    else:
        scale = m.sum(-1) if agg == "seq_mean_token_mean" else torch.full_like(m[:, 0], norm or 1)
        per_row, per_row_abs = (x * m).sum(-1) / scale, (x.abs() * m).sum(-1) / scale
    return float(per_row.sum()) / divisor, float(per_row_abs.sum()) / divisor


def _problems(runs: list[dict], case: Case, leak: bool) -> list[str]:
    """What the ranks' runs of ``case`` show wrong against the episodes' own action and
    observation tokens; empty when the mask holds."""
    problems = []
    got = [r[(str(case), leak)] for r in runs]
    layouts = [_layout(rank) for rank in range(WORLD)]
    for rank, ((actions, observations), res) in enumerate(zip(layouts, got)):
        if not (torch.equal(res["response_attention"].float(), actions + observations)
                and torch.equal(res["action_mask"], actions)):
            problems.append(f"rank {rank}: the rollout's action mask is not the episodes'")
        for key in ("kl", "advantages", "returns"):
            if bool(res[key][actions == 0].any()):
                problems.append(f"rank {rank}: {key} off the actions")
        # The trainer's log-probs against the engine's, on the actions alone: the gap is
        # computed from the same two float32 tensors, so only the order of the sum differs.
        diff, gap = res["logprob_diff"], res["logprob_gap"][actions.bool()].double()
        if diff.total["logprob_diff_count"] != float(actions.sum()) or \
                diff.most["logprob_diff"] != float(gap.max()) or \
                abs(diff.total["logprob_diff_sum"] - float(gap.sum())) > 1e-5 * float(gap.sum()):
            problems.append(f"rank {rank}: rollout/logprob_diff_* off the actions")
    for role in got[0]["roles"]:
        agg = case.agg if role == "actor" else "token_mean"  # the critic's loss is token_mean
        losses = [iter(r["roles"][role]["losses"]) for r in got]  # of the real micro-batches
        # Mini-batch j of every rank makes up the global mini-batch of optimizer step j.
        for j, micro_sets in enumerate(zip(*(r["roles"][role]["minis"] for r in got))):
            agreed = {len(micros) for micros in micro_sets}
            assert len(agreed) == 1, f"{role} ranks ran different micro-batch counts"
            count = sum(float(actions.sum()) if agg == "token_mean"
                        else float((actions.sum(-1) > 0).sum())  # the sequences with an action
                        for rank, micros in enumerate(micro_sets) for m in micros if m["weight"]
                        for actions in [layouts[rank][0][m["rows"]]])
            divisor = count / (WORLD * agreed.pop())
            for rank, micros in enumerate(micro_sets):
                for m in micros:
                    if m["divisor"] != divisor:
                        problems.append(f"rank {rank} {role} mini-batch {j}: divisor "
                                        f"{m['divisor']}, of the actions {divisor}")
                    if m["weight"]:
                        problems += _micro_problems(m, next(losses[rank]), divisor,
                                                    layouts[rank][0], got[rank]["num_tokens"],
                                                    case.packed, f"rank {rank} {role}")
        for rank, ((actions, observations), res) in enumerate(zip(layouts, got)):
            cells, other = res["roles"][role]["cells"], res["roles"][role]["other"]
            where = f"rank {rank} {role}"
            if bool((cells[observations.bool()] != 0).any()):
                problems.append(f"{where}: gradient at an observation")
            if bool((cells[(actions + observations) == 0] != 0).any()):
                problems.append(f"{where}: gradient at padding")
            if other != 0.0:
                problems.append(f"{where}: gradient where nothing is predicted")
            if not bool((cells[actions.bool()] != 0).all()):
                problems.append(f"{where}: an action without gradient")
    return problems


def _micro_problems(micro: dict, recorded: float, divisor: float, actions: torch.Tensor,
                    num_tokens: torch.Tensor, packed: bool, where: str) -> list[str]:
    """A real micro-batch's: its loss against the aggregate over the action tokens with the
    divisor of the actions, the masks its aggregations read, its real tokens against the
    budget."""
    problems = []
    hand = actions[micro["rows"]]
    if packed and int(num_tokens[micro["rows"]].sum()) > BUDGET:
        problems.append(f"{where}: a micro-batch over the token budget")
    # The policy term, then the KL term times its coefficient (ActorWorker.train).
    want, scale = 0.0, 0.0
    for coef, call in zip((1.0, KL_COEF), micro["aggregates"]):
        if not torch.equal(call["mask"], hand):
            problems.append(f"{where}: a loss term read a mask other than the actions")
        value, size = _aggregate(call["per_token"], hand, call["agg"], divisor, call["norm"])
        want, scale = want + coef * value, scale + coef * size
    # Error bound: from the same float32 terms, the worker's sums run over at most 4 rows x
    # 12 columns (a rank's mini-batch), then add the two loss terms, each addition rounding by
    # at most 2^-24 of its partial sum, and a division or two add as much: under
    # 52 * 2^-24 = 3.1e-6 of the terms' magnitudes. Allowed: 1e-5 of them.
    if abs(recorded - want) > 1e-5 * scale:
        problems.append(f"{where}: loss {recorded}, over the actions {want}")
    return problems


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    # Nothing is written there: the steps save no checkpoint (trainer.resume=none).
    return run_distributed(_rank, WORLD, str(tmp_path_factory.mktemp("action_mask")),
                           timeout=600)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_observations_get_no_gradient_and_are_not_counted(runs, case):
    assert _problems(runs, case, leak=False) == []


@pytest.mark.parametrize("case", CASES, ids=str)
def test_a_leaking_mask_fails_the_checks(runs, case):
    problems = _problems(runs, case, leak=True)
    roles = ("actor", "critic") if case.estimator == "gae" else ("actor",)
    for rank, role in itertools.product(range(WORLD), roles):
        assert f"rank {rank} {role}: gradient at an observation" in problems, problems
        assert any(p.startswith(f"rank {rank} {role}: loss ") for p in problems), problems
        if role == "critic" or case.agg == "token_mean":  # the seq_* modes count sequences
            assert any(p.startswith(f"rank {rank} {role} mini-batch") and "divisor" in p
                       for p in problems), problems


def test_a_case_s_config_is_the_one_its_keys_load(tmp_path):
    for case in (Case("grpo", "seq_mean_token_sum", True, True),
                 Case("reinforce_pp", "seq_mean_token_mean", False, False)):
        loaded = load(_argv(case, str(tmp_path)))
        made = _config(load(_argv(Case("gae", "token_mean", False, case.packed),
                                  str(tmp_path))), case)
        # A critic-free run drops the model its critic would inherit; none is built here.
        assert made.critic != loaded.critic
        assert dataclasses.replace(made, critic=loaded.critic) == loaded


def test_packed_micro_batches_count_every_real_token(runs):
    # Observations cost compute, so the token budget counts them (``_micro_problems`` checks each
    # micro-batch against it). Rank 1's first mini-batch, 26 real tokens, fits in 1 micro-batch
    # and runs a filler beside rank 0's 2; its second, 31 real tokens (23 without the
    # observations), takes 2.
    for case in (c for c in CASES if c.packed):
        for rank in range(WORLD):
            minis = runs[rank][(str(case), False)]["roles"]["actor"]["minis"]
            assert [len(micros) for micros in minis] == [2, 2]  # the count agreed
            real = sorted(int(sum(m["weight"] for m in micros)) for micros in minis)
            assert real == ([2, 2] if rank == 0 else [1, 2]), (case, rank, real)
