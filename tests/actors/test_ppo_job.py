"""A short PPO job on real Ray: four models, four different strategies, colocated on 4 CPU
devices (2 groups x 2, gloo). One Ray session and one job for the whole module: starting 16
workers is the expensive part, every test below reads the same run."""

from __future__ import annotations

import pytest
import ray

from rlhf_paro import models
from rlhf_paro.actors.group import init_ray
from rlhf_paro.metrics import COMM_PHASES, ROLES, read_jsonl, required_keys
from rlhf_paro.ppo.task import task_from_config
from rlhf_paro.sharding import Strategy
from rlhf_paro.sharding.cost import traffic
from rlhf_paro.sharding.layout import unit_sizes
from tests.confs import load
from tests.conftest import demo_cache

pytestmark = [pytest.mark.ray, pytest.mark.slow]

N, M = 4, 2
# III: the trained model crosses groups only at the boundary; NIG: no gathers at all, crosses
# groups at the boundary and the update; G: a frozen model gathering on the world ring; I: a
# frozen model gathering inside its group only.
STRATEGIES = {"actor": "III", "critic": "NIG", "ref": "G", "reward": "I"}
# The critic's optimizer steps on the host; ref and reward park between their phases.
OFFLOAD = {"critic": "optimizer", "ref": "params", "reward": "params"}
STEPS = 2


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("ppo")
    cfg = load([
        f"cluster.num_devices={N}", f"cluster.group_size={M}",
        *(f"{role}.strategy={s}" for role, s in STRATEGIES.items()),
        *(f"{role}.offload={mode}" for role, mode in OFFLOAD.items()),
        "task.model.hidden_size=32", "task.model.intermediate_size=64", "task.sft_steps=10",
        "task.train_prompts=64", "task.val_prompts=8",
        "actor.micro_batch_size=1", "critic.micro_batch_size=1",
        "reward.micro_batch_size=2", "ref.micro_batch_size=1",
        "ppo.rollout_batch_size=8", "ppo.mini_batch_size=8", "ppo.ppo_epochs=1",
        "task.reward_pairs=256", "task.reward_eval_pairs=64", "task.reward_steps=20",
        f"task.cache_dir={demo_cache()}", f"trainer.output_dir={out / 'run'}",
        f"trainer.steps={STEPS}", "logger.wandb.mode=disabled", "logger.progress=false",
        # The policy loss weighted by the engine/trainer ratio: in fp32 the weights are 1 within
        # ~1e-6, and the run goes through the path a mismatched engine would take.
        "rollout.tis_cap=2.0",
    ])
    init_ray(None, num_cpus=N, num_devices=N)
    from rlhf_paro.trainer import PPOTrainer

    trainer = PPOTrainer(cfg)
    dashboard = trainer.fit()
    trainer.shutdown()
    yield cfg, read_jsonl(str(out / "run" / "metrics.jsonl")), dashboard
    ray.shutdown()


def test_every_design_key_in_every_row(job):
    _, rows, dashboard = job
    assert len(rows) == STEPS
    for row in rows:
        missing = set(required_keys()) - set(row)
        assert not missing, f"step {row['step']} lacks {sorted(missing)}"
    assert dashboard.endswith("dashboard.png")


def test_the_hf_engine_s_logprobs_match_the_trainer_s_every_step(job):
    # Both fp32, the same weights: the key/value-cache path against the trainer's packed forward
    # differ by summation order, a few ulps of logits of size ~1 per layer, far below 1e-4.
    _, rows, _ = job
    for row in rows:
        assert 0.0 <= row["rollout/logprob_diff_mean"] <= row["rollout/logprob_diff_max"] <= 1e-4


def test_ref_starts_as_the_actor(job):
    # Same seed, same weights, different sharding: the first rollout's KL is zero up to
    # float32 reduction order.
    _, rows, _ = job
    assert abs(rows[0]["ppo/kl"]) < 1e-4
    assert 0.0 <= rows[0]["ppo/task_score"] <= 1.0


def _bytes(row, role, phase):
    return row[f"{role}/comm/{phase}/intra_bytes"], row[f"{role}/comm/{phase}/inter_bytes"]


def test_frozen_model_with_p_level_i_sends_nothing_across_groups(job):
    _, rows, _ = job
    for row in rows:
        assert row["reward/comm/inter_bytes"] == 0
        assert row["reward/comm/intra_bytes"] > 0  # it does gather, inside the group
        assert row["ref/comm/inter_bytes"] > 0  # G gathers on the world ring


def test_iii_crosses_groups_only_at_the_boundary(job):
    _, rows, _ = job
    for row in rows:
        for phase in COMM_PHASES:
            intra, inter = _bytes(row, "actor", phase)
            if phase == "boundary":
                assert inter > 0
            else:
                assert inter == 0, f"III sent {inter} bytes across groups in {phase}"
        assert _bytes(row, "actor", "generate")[0] > 0  # generation gathers once, in the group


def test_nig_gathers_nothing_and_reduces_inside_the_group(job):
    _, rows, _ = job
    for row in rows:
        assert _bytes(row, "critic", "forward") == (0, 0)  # P = N: nothing to gather
        intra, inter = _bytes(row, "critic", "backward")
        assert intra > 0 and inter == 0  # G = I: reduce-scatter on intra
        assert _bytes(row, "critic", "boundary")[1] > 0  # I -> G on inter
        assert _bytes(row, "critic", "update")[1] > 0  # G -> N all-gather on the world


def test_boundary_and_update_bytes_equal_the_cost_model(job):
    cfg, rows, _ = job
    vocab = task_from_config(cfg).tokenizer.vocab_size
    optimizer_steps = cfg.ppo.ppo_epochs * cfg.ppo.rollout_batch_size // cfg.ppo.mini_batch_size
    for role in ("actor", "critic"):
        units = unit_sizes(models.build_model(role, cfg.model(role), vocab, meta=True))
        # Per-rank average bytes per optimizer step; the metrics sum the N ranks.
        expected = traffic(Strategy.parse(STRATEGIES[role]), units, N, M,
                           cfg.grad_accum_steps(role), algorithm=cfg.comm.algorithm)
        for phase in ("boundary", "update"):
            for link, value in zip(("intra", "inter"), expected[phase]):
                measured = rows[-1][f"{role}/comm/{phase}/{link}_bytes"]
                assert measured == pytest.approx(value * N * optimizer_steps), (role, phase, link)


def test_memory_follows_the_strategies(job):
    _, rows, _ = job
    row = rows[-1]
    for role in ("reward", "ref"):
        assert row[f"{role}/mem/grads_bytes"] == 0 and row[f"{role}/mem/optim_bytes"] == 0
    # The actor's P is cut in M, its OS too; fp32 Adam holds 2 moments: OS = 2 P (no frozen part).
    assert row["actor/mem/optim_bytes"] == 2 * row["actor/mem/params_bytes"]
    # NIG: P replicated, G cut in M, OS cut in N, on the host (offload=optimizer): an fp32
    # master of its own and two moments, 12 bytes, and a 4-byte copy of the OS gradient.
    assert row["critic/mem/params_bytes"] == M * row["critic/mem/grads_bytes"]
    assert row["critic/mem/optim_bytes"] == 0
    assert row["critic/mem/host_optim_bytes"] == 3 * row["critic/mem/params_bytes"] // N
    assert row["critic/mem/host_grads_bytes"] == row["critic/mem/params_bytes"] // N
    for role in ROLES:
        assert row[f"{role}/mem/peak_bytes"] > 0
        assert row[f"{role}/tokens_per_s"] > 0


def test_offloaded_models_park_between_phases_and_count_their_copies(job):
    cfg, rows, _ = job
    row = rows[-1]  # the first step also counts the park after setting up
    optimizer_steps = cfg.ppo.ppo_epochs * cfg.ppo.rollout_batch_size // cfg.ppo.mini_batch_size
    # Per optimizer step each rank sends its OS gradient out and takes its masters back.
    for direction in ("d2h_bytes", "h2d_bytes"):
        assert row[f"critic/offload/{direction}"] == \
            N * optimizer_steps * row["critic/mem/host_grads_bytes"]
    for role in ("ref", "reward"):
        parked = row[f"{role}/mem/host_params_bytes"]
        # Parked at the end of the step, its P in host memory; brought back and parked again
        # once per scoring (the rollout, and an evaluation where one runs).
        assert row[f"{role}/mem/params_bytes"] == 0 and parked > 0
        moved = row[f"{role}/offload/d2h_bytes"]
        assert moved == row[f"{role}/offload/h2d_bytes"] and moved > 0
        assert moved % (N * parked) == 0
    assert row["actor/offload/transfers"] == 0
