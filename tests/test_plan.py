"""The planner: Table 2 memory for Llama-2-7B, fitting four models on a device, strategy=auto."""

import math

import pytest

from rlhf_paro.config import ConfigError, load_config
from rlhf_paro.plan import (
    GIB, choose_strategies, main, make_plan, model_plan, resolve_auto,
)
from rlhf_paro.sharding.strategy import Strategy

PSI = 6_738_415_616  # Llama-2-7B
N, M, K = 16, 8, 12  # 2 nodes x 8 GPUs; K = 12 bytes of optimizer state per bf16 parameter


@pytest.fixture(scope="module")
def llama():
    return load_config(["conf=ppo_llama7b"])


@pytest.fixture(scope="module")
def llama_plan(llama):
    return make_plan(llama)


# The rows of the paper's Table 2 (ZeRO++ is not a PaRO strategy), bytes per GPU, with 4 bytes
# per gradient element where Table 2 has 2: gradients accumulate in fp32 (docs/design.md, "bf16").
TABLE_2 = {
    "NNG": (2 * PSI, 4 * PSI, K * PSI // N),  # ZeRO-1
    "NGG": (2 * PSI, 4 * PSI // N, K * PSI // N),  # ZeRO-2
    "GGG": (2 * PSI // N, 4 * PSI // N, K * PSI // N),  # ZeRO-3
    "III": (2 * PSI // M, 4 * PSI // M, K * PSI // M),  # MiCS
    "IGG": (2 * PSI // M, 4 * PSI // N, K * PSI // N),
    "IIG": (2 * PSI // M, 4 * PSI // M, K * PSI // N),
    "NIG": (2 * PSI, 4 * PSI // M, K * PSI // N),
}


@pytest.mark.parametrize("name", sorted(TABLE_2))
def test_llama7b_memory_equals_table_2(llama_plan, name):
    option = llama_plan.models["actor"].option(Strategy.parse(name))
    assert (option.params_bytes, option.grads_bytes, option.optim_bytes) == TABLE_2[name]


def test_setup_peak_adds_the_largest_unit_gathered(llama_plan):
    # Llama-2-7B in bf16, units padded to a multiple of N. A causal LM's largest unit is its
    # root: embeddings and LM head (2 x 32000 x 4096) and the final norm; a value model has no
    # LM head, so a block is larger: attention 4 x 4096^2, MLP 3 x 4096 x 11008, two norms.
    root = 2 * 32000 * 4096 + 4096
    block = 4 * 4096 ** 2 + 3 * 4096 * 11008 + 2 * 4096
    for role, model in llama_plan.models.items():
        largest = root if role in ("actor", "ref") else block
        for option in model.options:
            assert option.setup_bytes == option.memory_bytes + 2 * (-(-largest // N) * N)


def test_frozen_models_hold_only_parameters_and_n_sends_nothing(llama_plan):
    ref = llama_plan.models["ref"]
    assert ref.num_params == PSI and ref.num_trainable == 0
    by_level = {o.strategy.name: o for o in ref.options}
    assert [by_level[x].params_bytes for x in "NIG"] == [2 * PSI, 2 * PSI // M, 2 * PSI // N]
    assert all(o.grads_bytes == o.optim_bytes == 0 for o in ref.options)
    assert by_level["N"].intra_bytes == by_level["N"].inter_bytes == 0
    assert by_level["I"].inter_bytes == 0 and by_level["I"].intra_bytes > 0


def test_recommendation_fits_the_device_and_beats_every_other_fitting_choice(llama, llama_plan):
    best = llama_plan.best
    assert sum(o.memory_bytes for o in best.values()) <= llama_plan.budget_bytes
    assert llama_plan.budget_bytes == 80 * GIB * 0.8
    # DDP keeps 16 bytes per parameter: 100 GiB for the actor alone cannot fit.
    assert Strategy.parse("NNN") not in llama_plan.fits["actor"]
    # Changing any single model's strategy to another that still fits is never faster.
    total = sum(o.seconds for o in best.values())
    for role, model in llama_plan.models.items():
        for option in model.options:
            others = sum(o.memory_bytes for r, o in best.items() if r != role)
            if others + option.memory_bytes <= llama_plan.budget_bytes:
                assert total - best[role].seconds + option.seconds >= total - 1e-6
    # The conf ships the planner's choice.
    assert {r: o.strategy for r, o in best.items()} == choose_strategies(llama)


def test_unlimited_memory_picks_each_models_least_traffic():
    cfg = load_config([])  # cpu, memory_gb unset
    plan = make_plan(cfg)
    assert math.isinf(plan.budget_bytes)
    for role, model in plan.models.items():
        assert plan.best[role].seconds == pytest.approx(min(o.seconds for o in model.options))


@pytest.mark.slow
def test_auto_respects_fixed_strategies_and_fails_clearly_when_nothing_fits(llama):
    cfg = load_config(["conf=ppo_llama7b", "actor.strategy=auto", "critic.strategy=auto",
                       "ref.strategy=G"])
    chosen = choose_strategies(cfg)
    assert chosen["ref"] == Strategy.parse("G", frozen=True)
    assert chosen["reward"] == Strategy.parse("I", frozen=True)
    resolved = resolve_auto(cfg)
    assert resolved.actor.strategy == chosen["actor"].name and cfg.actor.strategy == "auto"
    # 16 GiB minus the reserve cannot hold even four fully sharded 7B models (about 14.6 GiB).
    tight = load_config(["conf=ppo_llama7b", "actor.strategy=auto", "cluster.memory_gb=16"])
    with pytest.raises(ConfigError, match="actor.strategy: auto found no strategy"):
        choose_strategies(tight)


def test_trained_model_plan_counts_optimizer_steps_of_the_ppo_step():
    # Twice the epochs: the training part of the traffic doubles, the inference part stays.
    one, two = load_config(["ppo.ppo_epochs=1"]), load_config(["ppo.ppo_epochs=2"])
    igg = Strategy.parse("IGG")
    a = model_plan(one, "actor", 19).option(igg)
    b = model_plan(two, "actor", 19).option(igg)
    # Inference: 64 / 4 devices / 4 per micro-batch = 4 forwards + 1 gather for generation,
    # each an intra all-gather of the parameters (P = I) of which a device sends half (M = 2).
    num_params = model_plan(one, "actor", 19).num_params
    inference = 5 * 4 * num_params / 2
    assert a.intra_bytes > inference
    assert b.intra_bytes - inference == pytest.approx(2 * (a.intra_bytes - inference), abs=16)


def test_cli_prints_the_table_and_rejects_bad_input(capsys):
    main(["conf=ppo_llama7b", "cluster.nodes=4", "cluster.gpus_per_node=8"])
    out = capsys.readouterr().out
    assert "N=32 devices, M=8 per group, g=4 groups" in out
    assert out.count("<- recommended") == 4 and "recommended (the four models hold" in out
    assert "setup peak: " in out and "the conf's strategies hold" in out
    with pytest.raises(SystemExit) as info:
        main(["cluster.group_size=3"])
    assert info.value.code == 2
    assert capsys.readouterr().err.startswith("error: cluster.group_size: M=3 must divide")
