"""The planner: Table 2 memory for Llama-2-7B, fitting the run's models on a device (four, three
without a critic), strategy=auto."""

import math

import pytest

from rlhf_paro.config import ROLES, ConfigError
from rlhf_paro.plan import (
    ENGINE_SHARE_CAP, GIB, choose_strategies, configured_strategies, engine_share, format_plan,
    main, make_plan, model_plan, resolve_auto,
)
from rlhf_paro.sharding.strategy import Strategy
from tests.confs import INLINE, load

PSI = 6_738_415_616  # Llama-2-7B
N, M, K = 16, 8, 12  # 2 nodes x 8 GPUs; K = 12 bytes of optimizer state per bf16 parameter


@pytest.fixture(scope="module")
def llama():
    return load(["conf=ppo_llama7b"])


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


def _fits(plan, combo):
    """The planner's rule: the four states plus the largest peak of the one running."""
    states = sum(o.memory_bytes for o in combo.values())
    return all(o.best_within(plan.budget_bytes - states) for o in combo.values())


def test_recommendation_fits_the_device_and_beats_every_other_fitting_choice(llama, llama_plan):
    best = llama_plan.best
    assert _fits(llama_plan, {r: ch.option for r, ch in best.items()})
    states = sum(ch.memory_bytes for ch in best.values())
    assert states + max(ch.timed.peak_bytes for ch in best.values()) <= llama_plan.budget_bytes
    assert llama_plan.budget_bytes == 80 * GIB * 0.8
    # DDP keeps 16 bytes per parameter: 100 GiB for the actor alone cannot fit.
    assert Strategy.parse("NNN") not in llama_plan.fits["actor"]
    # Changing any single model's strategy to another that still fits is never faster. The fit
    # now counts the running model's activations and buffers, not only P + G + OS: a critic
    # of III holds 4.6 GiB more states than IIG, which the old rule let through, and then the
    # critic's 5.0 GiB training peak no longer fits (64.4 of 64 GiB).
    total = sum(ch.seconds for ch in best.values())
    for role, model in llama_plan.models.items():
        for option in model.options:
            combo = {**{r: ch.option for r, ch in best.items()}, role: option}
            if _fits(llama_plan, combo):
                assert total - best[role].seconds + option.seconds >= total - 1e-6
    # The conf ships the planner's choice.
    assert {r: ch.strategy for r, ch in best.items()} == choose_strategies(llama)


def test_recommendation_is_explained_in_predicted_times(llama, llama_plan):
    out = format_plan(llama, llama_plan)
    chosen = llama_plan.best["actor"]
    assert f"actor  {chosen.strategy}: {chosen.seconds:.4g} s/PPO step predicted" in out
    assert "exposed communication" in out and "key/value cache" in out
    # Each model's table is ranked by predicted time, fastest first.
    table = out[out.index("actor: Psi"):out.index("critic: Psi")].splitlines()[3:17]
    times = [float(line.split()[13]) for line in table]  # the s/step column
    assert len(times) == 14 and times == sorted(times)


def test_unlimited_memory_picks_each_models_least_time():
    cfg = load([])  # cpu, memory_gb unset
    plan = make_plan(cfg)
    assert math.isinf(plan.budget_bytes)
    for role, model in plan.models.items():
        assert plan.best[role].seconds == pytest.approx(min(o.seconds for o in model.options))


def test_max_micro_batch_size_lets_the_planner_grow_a_micro_batch():
    # ppo_tiny: a mini-batch of 32 over 4 devices, so the actor may take 4 or 8 per
    # micro-batch; 8 halves its micro-batches per optimizer step, and with them the
    # per-micro-batch collectives, so it never predicts more time and needs more memory.
    argv = ["actor.max_micro_batch_size=8", "actor.strategy=auto", "critic.strategy=auto"]
    fixed = make_plan(load(argv[1:]), vocab_sizes=dict.fromkeys(ROLES, 19))
    grown = make_plan(load(argv), vocab_sizes=dict.fromkeys(ROLES, 19))
    actor = grown.models["actor"]
    assert all(list(o.by_micro) == [4, 8] for o in actor.options)
    assert all(o.by_micro[8].seconds <= o.by_micro[4].seconds for o in actor.options)
    assert all(o.by_micro[8].peak_bytes > o.by_micro[4].peak_bytes for o in actor.options)
    # A strategy that gathers or reduces every micro-batch gains; one that does not, like NNI,
    # gains only what the longer last backward hides of its boundary reduction, which starts
    # there (sharding/steptime.py, [Note: the step-time model]): well under 1%.
    ggg, nni = (actor.option(Strategy.parse(x)) for x in ("GGG", "NNI"))
    assert ggg.by_micro[8].seconds < ggg.by_micro[4].seconds
    assert nni.by_micro[8].seconds <= nni.by_micro[4].seconds
    assert nni.by_micro[8].seconds == pytest.approx(nni.by_micro[4].seconds, rel=0.01)
    # Memory unlimited: the larger micro-batch, and never more predicted time than without it.
    assert grown.best["actor"].micro_batch == 8
    assert sum(c.seconds for c in grown.best.values()) <= \
        sum(c.seconds for c in fixed.best.values())
    # With one byte less than the peak of 8 above the states, an option falls back to 4.
    option = grown.best["actor"].option
    assert option.best_within(option.by_micro[8].peak_bytes - 1)[0] == 4
    assert option.best_within(option.by_micro[4].peak_bytes - 1) is None
    resolved = resolve_auto(load(argv), vocab_sizes=dict.fromkeys(ROLES, 19))
    assert (resolved.actor.micro_batch_size, resolved.critic.micro_batch_size) == (8, 4)


@pytest.mark.slow
def test_auto_respects_fixed_strategies_and_fails_clearly_when_nothing_fits(llama):
    cfg = load(["conf=ppo_llama7b", "actor.strategy=auto", "critic.strategy=auto",
                       "ref.strategy=G"])
    chosen = choose_strategies(cfg)
    assert chosen["ref"] == Strategy.parse("G", frozen=True)
    assert chosen["reward"] == Strategy.parse("I", frozen=True)
    resolved = resolve_auto(cfg)
    assert resolved.actor.strategy == chosen["actor"].name and cfg.actor.strategy == "auto"
    # 16 GiB minus the reserve cannot hold even four fully sharded 7B models (about 14.6 GiB).
    tight = load(["conf=ppo_llama7b", "actor.strategy=auto", "cluster.memory_gb=16"])
    with pytest.raises(ConfigError, match="actor.strategy: auto found no strategy"):
        choose_strategies(tight)


def test_trained_model_plan_counts_optimizer_steps_of_the_ppo_step():
    # Twice the epochs: the training part of the traffic doubles, the inference part stays.
    one, two = load(["ppo.ppo_epochs=1"]), load(["ppo.ppo_epochs=2"])
    igg = Strategy.parse("IGG")
    a = model_plan(one, "actor", 19).option(igg)
    b = model_plan(two, "actor", 19).option(igg)
    # Inference: 64 / 4 devices / 4 per micro-batch = 4 forwards + 1 gather for generation,
    # each an intra all-gather of the parameters (P = I) of which a device sends half (M = 2).
    num_params = model_plan(one, "actor", 19).num_params
    inference = 5 * 4 * num_params / 2
    assert a.intra_bytes > inference
    assert b.intra_bytes - inference == pytest.approx(2 * (a.intra_bytes - inference), abs=16)


def test_gradient_traffic_and_time_follow_reduce_dtype():
    # ppo_tiny with bf16 parameters: N = 4, 4 optimizer steps of s = 2 micro-batches per PPO
    # step. NGG reduce-scatters each unit's padded gradient over the world every micro-batch,
    # a device sending 3/4 of it; fp32 reductions send 2 bytes per element more than bf16.
    from rlhf_paro.models import build_model
    from rlhf_paro.sharding.layout import padded, unit_sizes

    ngg = Strategy.parse("NGG")
    cfgs = {dtype: load(["actor.precision=bf16", f"actor.reduce_dtype={dtype}"])
            for dtype in ("fp32", "bf16")}
    options = {dtype: model_plan(cfg, "actor", 19).option(ngg) for dtype, cfg in cfgs.items()}
    units = unit_sizes(build_model("actor", cfgs["bf16"].actor, 19, meta=True))
    grads = sum(padded(u.trainable, 4) for u in units)

    def sent(o):
        return o.intra_bytes + o.inter_bytes

    assert sent(options["fp32"]) - sent(options["bf16"]) == 4 * 2 * grads * 3 // 4 * 2
    # The step-time model reads the same dtype: the fp32 reductions take longer, and the
    # gradient accumulator holds 4 bytes per element in both (G = grads / N of them).
    assert options["fp32"].seconds > options["bf16"].seconds
    assert options["fp32"].grads_bytes == options["bf16"].grads_bytes == 4 * grads // 4


def test_cli_prints_the_table_and_rejects_bad_input(capsys):
    main(["conf=ppo_llama7b", "cluster.nodes=4", "cluster.gpus_per_node=8"])
    out = capsys.readouterr().out
    assert "N=32 devices, M=8 per group, g=4 groups" in out
    # The summary line gives the predicted time and the peak, not only the states.
    assert out.count("<- recommended") == 4 and "s per PPO step predicted; the four hold" in out
    assert "setup peak: " in out and "; setup peak " in out
    with pytest.raises(SystemExit) as info:
        main(["cluster.group_size=3"])
    assert info.value.code == 2
    assert capsys.readouterr().err.startswith("error: cluster.group_size: M=3 must divide")


def test_offload_columns_give_the_device_bytes_each_mode_leaves_between_phases(llama_plan):
    # The conf offloads nothing, so P, G and OS are Table 2's and "none" is their sum.
    for role, model in llama_plan.models.items():
        for o in model.options:
            placed = o.device_by_offload
            assert placed["none"] == o.memory_bytes
            if role in ("reward", "ref"):  # frozen: no optimizer, parked P leaves nothing
                assert placed == {"none": o.params_bytes, "params": 0}
                continue
            assert placed["optimizer"] == o.params_bytes + o.grads_bytes  # OS on the host
            if role == "critic":  # P parked between its phases
                assert placed["params"] == o.grads_bytes + o.optim_bytes
            else:  # the actor runs in every phase: nothing to park
                assert "params" not in placed


def test_configured_offload_is_what_the_planner_fits():
    # 24 GiB per GPU: no combination of the four fits with everything on the device.
    tight = ["conf=ppo_llama7b", "cluster.memory_gb=24"]
    offloads = ["actor.offload=optimizer", "critic.offload=optimizer", "ref.offload=params",
                "reward.offload=params"]
    without = make_plan(load(tight))
    assert without.best is None
    plan = make_plan(load(tight + offloads))
    assert plan.best is not None
    for role, choice in plan.best.items():
        o, plain = choice.option, without.models[role].option(choice.strategy)
        if role in ("actor", "critic"):
            # The OS moves to the host with a copy of the OS gradient: K = 12 plus 4 bytes.
            assert o.optim_bytes == 0 and o.host_bytes == plain.optim_bytes * 16 // 12
            assert o.memory_bytes == plain.params_bytes + plain.grads_bytes
        else:
            # Parked between phases; back on the device (in its peak) while it runs.
            assert o.memory_bytes == 0 and o.host_bytes == plain.params_bytes
            assert o.configured.peak_bytes == plain.configured.peak_bytes + plain.params_bytes
    assert f"offload=params: {plan.best['ref'].strategy} also holds" in format_plan(
        load(tight + offloads), plan)


# The default run with inline models, critic-free: GRPO takes its baseline from 4 samples a prompt.
GRPO = [*INLINE, "algorithm.adv_estimator=grpo", "rollout.n=4"]
VOCAB = dict.fromkeys(ROLES, 19)


def test_a_critic_free_run_plans_three_models_and_says_what_the_critic_would_hold(capsys):
    main(GRPO)
    out = capsys.readouterr().out
    plan = make_plan(load(GRPO), vocab_sizes=VOCAB)
    assert tuple(plan.models) == tuple(plan.best) == ("actor", "reward", "ref")
    assert "critic: Psi" not in out and "  critic " not in out
    assert out.count("<- recommended") == 3 and "while the three models set up" in out
    # The critic the same conf would build under PPO, planned there with the other three: the
    # line gives its leanest strategy's device bytes (memory unlimited, so every option fits).
    ppo = make_plan(load(GRPO[:-2]), vocab_sizes=VOCAB)
    leanest = min(ppo.models["critic"].options, key=lambda o: o.memory_bytes)
    assert leanest.strategy == Strategy.parse("GGG")  # everything sharded over all 4 devices
    assert (f"no critic (algorithm.adv_estimator=grpo): frees "
            f"{leanest.memory_bytes / 2 ** 20:.2f} MiB per device that a critic under GGG (its "
            "leanest strategy that fits) would hold; the three models use it") in out
    # A run with a critic prints no such line.
    assert ppo.absent_critic is None


def test_auto_chooses_only_for_the_run_s_models():
    autos = ["actor.strategy=auto", "critic.strategy=auto", "reward.strategy=auto",
             "ref.strategy=auto"]
    cfg = load([*GRPO, *autos])
    assert set(choose_strategies(cfg, VOCAB)) == {"actor", "reward", "ref"}
    resolved = resolve_auto(cfg, VOCAB)
    assert "auto" not in (resolved.actor.strategy, resolved.reward.strategy,
                          resolved.ref.strategy)
    assert resolved.critic.strategy == "auto"  # no critic is built: left as the conf has it
    # Without a KL nothing reads ref: two models.
    no_kl = load([*GRPO, *autos, "algorithm.kl_coef=0"])
    assert set(choose_strategies(no_kl, VOCAB)) == {"actor", "reward"}
    plan = make_plan(no_kl, vocab_sizes=VOCAB)
    assert tuple(plan.models) == ("actor", "reward")
    assert "while the two models set up" in format_plan(no_kl, plan)


def test_rollout_n_multiplies_the_samples_a_step_costs():
    # 128 prompts sampled once and 64 sampled twice are the same 128 sequences: every model's
    # forwards, the trained models' optimizer steps (128 / 32 mini-batch x 2 epochs) and the
    # actor's key/value cache are the same.
    once = make_plan(load([*INLINE, "ppo.rollout_batch_size=128"]), vocab_sizes=VOCAB)
    twice = make_plan(load([*INLINE, "rollout.n=2"]), vocab_sizes=VOCAB)
    half = make_plan(load(INLINE), vocab_sizes=VOCAB)  # 64 sequences
    assert twice.models["actor"].kv_cache_bytes == once.models["actor"].kv_cache_bytes == \
        2 * half.models["actor"].kv_cache_bytes
    for role in ROLES:
        for a, b, c in zip(once.models[role].options, twice.models[role].options,
                           half.models[role].options):
            assert (b.seconds, b.intra_bytes, b.inter_bytes) == \
                (a.seconds, a.intra_bytes, a.inter_bytes)
            assert b.seconds > c.seconds  # n counts: twice the samples take longer


def test_a_reward_function_is_planned_as_a_model_that_holds_and_sends_nothing(tmp_path):
    # conf=grpo_tiny's shape: the reward is a rule, not a model.
    (tmp_path / "rule.py").write_text("def score(prompts, responses):\n    return [1.0]\n")
    cfg = load([*GRPO, f"reward.function={tmp_path / 'rule.py'}:score",
                       "data.train_files=null"])
    reward = make_plan(cfg, vocab_sizes=VOCAB).models["reward"]
    assert reward.num_params == 0
    assert all(o.memory_bytes == 0 and o.intra_bytes == o.inter_bytes == 0
               for o in reward.options)


# Sequences of at most 8 + 56 = 64 tokens; ppo.expected_response_length=24 expects 8 + 24 = 32.
LONG = [*INLINE, "ppo.max_new_tokens=56", "critic.packing=false"]


def _options(argv):
    plan = make_plan(load(argv), vocab_sizes=VOCAB)
    return {role: {o.strategy: o.configured for o in m.options} for role, m in plan.models.items()}


def test_compute_follows_the_expected_length_of_packed_models_and_memory_the_longest():
    # A packed model computes on real tokens: with 24 expected of 56 its compute is exactly that
    # of a run whose every response is 24 long (what the step costs follows the real tokens, not
    # the budget), while its memory stays that of 56: a plan that fits must fit any rollout.
    # The critic runs padded (packing=false): it computes on 64 positions whatever is expected.
    expected = _options([*LONG, "ppo.expected_response_length=24"])
    worst = _options(LONG)
    short = _options([*INLINE, "ppo.max_new_tokens=24", "critic.packing=false"])
    for role in ("actor", "reward", "ref", "critic"):
        for strategy, t in expected[role].items():
            assert t.peak_bytes == worst[role][strategy].peak_bytes
            like = worst if role == "critic" else short
            assert t.compute == pytest.approx(like[role][strategy].compute, rel=1e-12)
    # Halving the expected real tokens (64 -> 32) lowers a packed model's compute in proportion
    # to a sequence's forward FLOPs: linear in its length, plus causal attention's square term.
    from rlhf_paro.models import build_model
    from rlhf_paro.sharding.layout import unit_sizes
    from rlhf_paro.sharding.steptime import transformer_workload

    cfg = load(LONG)
    units = unit_sizes(build_model("actor", cfg.actor, 19, meta=True))

    def flops(length):
        return sum(transformer_workload(units, hidden=64, ffn=128, vocab=19,
                                        seq_len=length).flops)

    igg = Strategy.parse("IGG")
    ratio = expected["actor"][igg].compute / worst["actor"][igg].compute
    assert ratio == pytest.approx(flops(32) / flops(64), rel=1e-12)
    assert 0.25 < ratio < 0.5 and expected["actor"][igg].seconds < worst["actor"][igg].seconds


def test_a_token_budget_bounds_training_activations_never_below_its_sequences_at_their_longest():
    # ppo_tiny: 8 sequences of a mini-batch per device, micro-batches of 4, sequences of at most
    # 64 tokens. A budget of 4 x 64 tokens may hold 4 sequences at their longest: never a smaller
    # peak than micro-batches of 4 such sequences. A budget of 64 holds fewer tokens, whose
    # first-fit rows take at most 2 x 64 + 64 positions: less than 4 x 64.
    plain = _options(LONG)
    wide = _options([*LONG, "actor.max_tokens_per_micro_batch=256"])
    narrow = _options([*LONG, "actor.max_tokens_per_micro_batch=64"])
    for strategy, t in plain["actor"].items():
        assert wide["actor"][strategy].peak_bytes >= t.peak_bytes
        assert narrow["actor"][strategy].peak_bytes <= wide["actor"][strategy].peak_bytes
    assert any(narrow["actor"][s].peak_bytes < t.peak_bytes for s, t in plain["actor"].items())


def test_first_fit_rows_of_a_token_budget_stay_below_twice_the_budget_plus_the_longest():
    # The bound the planner takes for a packed micro-batch under max_tokens_per_micro_batch=B
    # (plan/cost.py, [Note: real tokens]): K rows as wide as the longest W hold K x W < 2 B + W
    # positions, whatever the lengths.
    import torch

    from rlhf_paro import batching

    gen = torch.Generator().manual_seed(0)
    # Lengths just over half the longest are the worst case: one sequence a row.
    cases = [torch.tensor([64] + [33] * 40)] + \
        [torch.randint(1, 65, (40,), generator=gen) for _ in range(50)]
    most = {}
    for lengths in cases:
        for budget in (64, 100, 256, 1024):
            for micro in batching.split_by_tokens(torch.arange(len(lengths)), lengths, budget):
                sizes = lengths[micro].tolist()
                width = max(sizes)
                positions = len(batching.first_fit_decreasing(sizes, width)) * width
                assert positions < 2 * budget + width
                most[budget] = max(most.get(budget, 0), positions)
    # The budget alone would not do: 1021 real tokens (64 + 29 x 33) take 30 rows of 64.
    assert most[1024] == 30 * 64


def test_the_plan_says_which_lengths_it_sized_memory_and_compute_by():
    cfg = load([*LONG, "ppo.expected_response_length=24", "actor.max_tokens_per_micro_batch=128"])
    out = format_plan(cfg, make_plan(cfg, vocab_sizes=VOCAB))
    assert ("tokens per sequence: memory by the longest, 64 (data.max_prompt_length=8 + "
            "ppo.max_new_tokens=56); compute by the expected 32 (data.max_prompt_length=8 + "
            "ppo.expected_response_length=24) for actor, reward, ref (packed); the padded 64 for "
            "critic (packing off)") in out.splitlines()
    # 8 sequences of a mini-batch per device, 32 tokens each expected: 2 micro-batches of 128.
    assert "s=2 expected under max_tokens_per_micro_batch=128" in out


# --- a rollout engine with a copy of its own (rollout.engine=vllm) -------------------------------
def test_a_syncing_engine_s_gather_is_the_sync_in_place_of_generation_s():
    # hf generates on the actor's parameters, gathered once per PPO step; vllm generates on its
    # own copy, which the actor syncs once per PPO step, every unit gathered at P's scope: the
    # same gathers under phase sync. So the actor's bytes and time per step are hf's exactly
    # (one gather fewer to generate, one more to sync), and the sync alone is one gather.
    from rlhf_paro.comm.topology import Topology
    from rlhf_paro.models import build_model
    from rlhf_paro.plan import machine
    from rlhf_paro.sharding.cost import traffic
    from rlhf_paro.sharding.layout import padded, unit_sizes
    from rlhf_paro.sharding.steptime import gather_seconds, transformer_workload
    from rlhf_paro.sharding.strategy import Level

    hf_cfg = load(INLINE)
    vllm_cfg = load([*INLINE, "rollout.engine=vllm"], engine_check=False)
    hf, vllm = (make_plan(c, vocab_sizes=VOCAB) for c in (hf_cfg, vllm_cfg))
    assert hf.models["actor"].sync == {}
    sync = vllm.models["actor"].sync
    assert set(sync) == set(Level)
    units = unit_sizes(build_model("actor", vllm_cfg.actor, 19, meta=True))
    n, m, algorithm = 4, 2, vllm_cfg.comm.algorithm  # ppo_tiny: 2 groups of 2, fp32
    # Gathers depend on the units and the precision only, not on the sequences.
    work = transformer_workload(units, hidden=64, ffn=128, vocab=19, seq_len=1, precision="fp32")
    for level, s in sync.items():
        once = traffic(Strategy(level), units, n, m, 1, "fp32", algorithm)["forward"]
        assert (s.intra_bytes, s.inter_bytes) == once
        assert s.seconds == gather_seconds(Strategy(level), work, Topology(n, m),
                                           machine(vllm_cfg), algorithm)
    # P = N holds every unit whole: nothing to send; P = I: half of every padded buffer, in fp32,
    # inside the group.
    assert sync[Level.N] == (0, 0, 0.0)
    buffers = sum(padded(u.trainable, n) + padded(u.frozen, n) for u in units)
    assert (sync[Level.I].intra_bytes, sync[Level.I].inter_bytes) == (4 * buffers / 2, 0)
    for a, b in zip(hf.models["actor"].options, vllm.models["actor"].options):
        assert (b.intra_bytes, b.inter_bytes, b.seconds) == (a.intra_bytes, a.inter_bytes,
                                                             a.seconds)
        # The sync holds one unit gathered where generation held all of them.
        assert b.configured.peak_bytes <= a.configured.peak_bytes
    for role in ("critic", "reward", "ref"):
        assert vllm.models[role].options == hf.models[role].options
    out = format_plan(vllm_cfg, vllm)
    assert "sync into the vllm engine once per PPO step" in out and "P=N nothing" in out
    assert "key/value cache are not counted (a CPU device)" in out


@pytest.fixture(scope="module")
def llama_vllm():
    cfg = load(["conf=ppo_llama7b", "rollout.engine=vllm", "rollout.gpu_memory_utilization=0.4"],
               engine_check=False)
    return cfg, make_plan(cfg)


def test_vllm_s_share_of_the_device_is_in_the_actor_s_generation_peak_only(llama_plan,
                                                                          llama_vllm):
    # [Note: a rollout engine's memory] rollout.gpu_memory_utilization=0.4 of 80 GiB: 32 GiB,
    # holding the 7B weights in bf16. Generation's peak is that share plus the one unit the
    # sync holds gathered: the root (embeddings, LM head, final norm) padded to N, in bf16,
    # for P other than N. Every training peak here is a few GiB, under it.
    cfg, plan = llama_vllm
    actor = plan.models["actor"]
    share = 0.4 * 80 * GIB
    assert actor.engine_bytes == share and actor.engine_weights == 2 * PSI
    root = 2 * (-(-(2 * 32000 * 4096 + 4096) // N) * N)
    for o in actor.options:
        unit = 0 if o.strategy.params.name == "N" else root
        assert o.configured.peak_bytes == share + unit
        # The engine starts at setup once the actor's states are on the device.
        assert o.setup_bytes == o.memory_bytes + math.ceil(share)
    # Asleep while the others score and train: their peaks are hf's.
    for role in ("critic", "reward", "ref"):
        assert plan.models[role].options == llama_plan.models[role].options
    best = plan.best
    states = sum(ch.memory_bytes for ch in best.values())
    assert states + best["actor"].timed.peak_bytes <= plan.budget_bytes
    # The conf's strategies fit beside hf (57.5 GiB of states), not beside the engine's 32 GiB.
    conf = sum(plan.models[r].option(s).memory_bytes for r, s in configured_strategies(cfg).items())
    assert conf + share > plan.budget_bytes
    assert set(configured_strategies(cfg).items()) <= {(r, ch.strategy)
                                                       for r, ch in llama_plan.best.items()}
    out = format_plan(cfg, plan)
    assert ("the vllm engine takes 32.00 GiB (rollout.gpu_memory_utilization=0.4 x "
            "cluster.memory_gb=80), 12.55 GiB of weights") in out
    sync = actor.sync[best["actor"].strategy.params]
    assert f"actor  {best['actor'].strategy}: " in out and (
        f"of which the sync {sync.seconds:.3g} s" in out if sync.seconds else
        "the sync nothing at P=N" in out)


def test_vllm_s_weights_and_one_sequence_s_cache_must_fit_in_its_share():
    # The least the engine starts with: the weights, 2 x Psi bytes in bf16, and the key/value
    # cache of one sequence of 1024 + 1024 tokens and one block of 16 more: 2 (key, value) x
    # 32 layers x 32 heads x 128 x 2 bytes a token. 14.56e9 bytes, 0.1695 of 80 GiB: 0.16
    # gives 13.7e9, 0.17 gives 14.6e9.
    least = 2 * PSI + 2 * 32 * 32 * 128 * 2 * (2048 + 16)
    assert 0.16 * 80 * GIB < least < 0.17 * 80 * GIB
    argv = ["conf=ppo_llama7b", "rollout.engine=vllm"]
    with pytest.raises(ConfigError, match=r"rollout.gpu_memory_utilization: 0.16 of "
                                          r"cluster.memory_gb=80 .* allowed: at least 0.17$"):
        model_plan(load([*argv, "rollout.gpu_memory_utilization=0.16"], engine_check=False),
                   "actor", 32000)
    actor = model_plan(load([*argv, "rollout.gpu_memory_utilization=0.17"], engine_check=False),
                       "actor", 32000)
    assert actor.engine_bytes == 0.17 * 80 * GIB


def test_engine_share_is_what_the_models_leave_rounded_down_capped_and_at_least_the_least():
    # [Note: the engine's share, auto] A device of 100 bytes, 20 of them reserved: states 30
    # and the sync's unit 5 leave 45 while generating; setup peaks of 40 leave 60 as it starts.
    assert engine_share(100, 0.2, 30, 5, 40, 10) == 0.45
    # The start the tighter: setup peaks of 70 leave 30.
    assert engine_share(100, 0.2, 30, 5, 70, 10) == 0.30
    # Rounded down to the hundredth: 45.9 bytes give 0.45, not 0.46 (more than is left).
    assert engine_share(100, 0.2, 30, 4.1, 40, 10) == 0.45
    # Nothing else on the device: the cap, not the whole budget.
    assert engine_share(100, 0.0, 0, 0, 0, 10) == ENGINE_SHARE_CAP == 0.9
    # A share below the least (0.04 of a least of 5 bytes): refused.
    with pytest.raises(ConfigError, match=r"^rollout.gpu_memory_utilization: auto: the run's "
                                          r"models leave .* allowed: auto with more devices or "
                                          r"memory, or a number in \(0, 1\]$"):
        engine_share(100, 0.2, 70, 6, 40, 5)


LLAMA_SIZES = {role: 32000 for role in ROLES}


def test_auto_gives_the_llama_s_engine_what_its_models_leave_and_the_plan_then_fits(llama_plan):
    argv = ["conf=ppo_llama7b", "rollout.engine=vllm",
            *(f"{role}.strategy=auto" for role in ROLES)]
    cfg = load(argv, engine_check=False)
    assert cfg.rollout.gpu_memory_utilization == "auto"
    resolved = resolve_auto(cfg, LLAMA_SIZES)
    share = resolved.rollout.gpu_memory_utilization
    # The least: the weights and one sequence's cache, 2048 tokens and the null block of 32
    # (vllm.BLOCK_TOKENS), 0.1696 of 80 GiB.
    least = 2 * PSI + 2 * 32 * 32 * 128 * 2 * (2048 + 32)
    assert least < share * 80 * GIB
    # At the share, the resolved strategies fit (the budget and the setup peaks), and a
    # hundredth more would not: the share is all the models leave.
    fixed = configured_strategies(resolved)
    plan = make_plan(resolved, fixed=fixed)
    assert plan.best is not None
    bigger = make_plan(load([*argv, f"rollout.gpu_memory_utilization={share + 0.01:.2f}",
                             *(f"{r}.strategy={s}" for r, s in fixed.items())],
                            engine_check=False), fixed=fixed)
    assert bigger.best is None
    # The strategies hf runs with do not leave the engine its least: auto chose leaner ones.
    assert set(fixed.items()) != {(r, ch.strategy) for r, ch in llama_plan.best.items()}
    # Before the strategies are chosen the planner's table counts the engine at its least.
    assert (f"the vllm engine takes at least {least / GIB:.2f} GiB (rollout."
            "gpu_memory_utilization=auto: what the chosen strategies leave, set as the run "
            "starts)") in format_plan(cfg, make_plan(cfg))


def test_auto_on_cuda_without_memory_gb_and_a_share_too_small_are_one_line_errors():
    argv = ["conf=ppo_llama7b", "rollout.engine=vllm"]
    with pytest.raises(ConfigError, match=r"^rollout.gpu_memory_utilization: auto sizes the vllm "
                                          r"engine on CUDA from cluster.memory_gb, which is null"):
        resolve_auto(load([*argv, "cluster.memory_gb=null"], engine_check=False), LLAMA_SIZES)
    # The conf's own strategies hold 57.5 GiB of the 64 GiB budget: no room for the engine's
    # least, 13.6 GiB.
    with pytest.raises(ConfigError, match=r"^rollout.gpu_memory_utilization: auto: the run's "
                                          r"models leave"):
        resolve_auto(load(argv, engine_check=False), LLAMA_SIZES)


def test_the_planner_plans_vllm_where_vllm_is_not_installed(monkeypatch, capsys):
    # The engine's own check (installed, architecture served) is the trainer's, on the machine
    # that runs it; the planner checks the engine's name and imports nothing of vLLM.
    import sys

    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm fails, find_spec finds none
    with pytest.raises(ConfigError, match="rollout.engine: vllm is not installed"):
        load([*INLINE, "rollout.engine=vllm"])
    main([*INLINE, "rollout.engine=vllm"])
    out = capsys.readouterr().out
    assert "sync into the vllm engine once per PPO step" in out
    assert sys.modules["vllm"] is None


# --- generation and the order of a step (rollout.num_devices, rollout.max_staleness) -------------
# Round machine numbers, so that every prediction below is worked by hand: 1e9 parameters held
# in 2e9 bytes, 1e6 bytes of key/value cache a token, 1000 GB/s of memory and 100 TFLOP/s.
PARAMS, WEIGHTS, KV = 10 ** 9, 2 * 10 ** 9, 10 ** 6
MACHINE = ["cluster.memory_gbps=1000", "cluster.tflops=100"]
# ppo_tiny's cluster is 4 devices; 8 prompts x 2 samples, prompts of up to 8 tokens (INLINE's
# data.max_prompt_length), responses of up to 8.
SMALL = [*INLINE, *MACHINE, "ppo.rollout_batch_size=8", "rollout.n=2", "ppo.mini_batch_size=8",
         "ppo.max_new_tokens=8", "critic.micro_batch_size=1", "actor.micro_batch_size=1"]


def test_hf_generation_decodes_padded_batches_to_the_bound_reading_weights_and_cache():
    from rlhf_paro.plan import generation

    cfg = load([*SMALL, "rollout.micro_batch_size=1"])
    assert cfg.prompt_bound()[1] == 8 and cfg.cluster.num_devices == 4
    g = generation(cfg, PARAMS, WEIGHTS, KV)
    # 16 samples over 4 engines: 4 each, decoded 1 prompt x 2 samples at a time, in 2 batches
    # that each run the 8 tokens of the bound: 16 steps. A step reads the weights and 2
    # sequences' cache at 8 + 8 / 2 = 12 tokens: 2e9 + 2 x 1e6 x 12 = 2.024e9 bytes at 1e12 B/s,
    # 2.024 ms; its FLOPs, 2 x 1e9 x 2 = 4e9 at 1e14, 0.04 ms: memory-bound. Prefill: 4 x 8
    # prompt tokens x 2e9 FLOPs at 1e14, 0.64 ms. In all 16 x 2.024 + 0.64 = 33.024 ms.
    assert (g.engines, g.sequences, g.concurrent, g.steps) == (4, 4, 2, 16)
    assert g.memory_bound
    # Float sums of a few terms: relative error of a few ulps, far below 1e-12.
    assert g.step_seconds == pytest.approx(2.024e-3, rel=1e-12)
    assert g.prefill_seconds == pytest.approx(0.64e-3, rel=1e-12)
    assert g.seconds == pytest.approx(33.024e-3, rel=1e-12)
    # A slow enough device is bound by its FLOPs instead: at 0.001 TFLOP/s a step's 4e9 FLOPs
    # take 4 s, the 2.024e9 bytes still 2.024 ms.
    slow = generation(load([*SMALL, "rollout.micro_batch_size=1", "cluster.tflops=0.001"]),
                      PARAMS, WEIGHTS, KV)
    assert not slow.memory_bound and slow.step_seconds == pytest.approx(4.0, rel=1e-12)


def test_vllm_generation_refills_its_batch_and_is_bounded_by_its_cache_share():
    from rlhf_paro.plan import generation

    base = [*SMALL, "rollout.engine=vllm", "rollout.num_devices=2", "rollout.max_num_seqs=3",
            "ppo.expected_response_length=4"]
    g = generation(load(base, engine_check=False), PARAMS, WEIGHTS, KV)
    # 2 replicas of their own, 8 samples each, 3 at a time (max_num_seqs): continuous batching
    # decodes 8 x 4 expected tokens in ceil(32 / 3) = 11 steps, each reading 2e9 + 3 x 1e6 x
    # (8 + 4 / 2) = 2.03e9 bytes, 2.03 ms. Prefill: 8 x 8 x 2e9 / 1e14 = 1.28 ms.
    assert (g.engines, g.sequences, g.concurrent, g.steps) == (2, 8, 3, 11)
    assert g.seconds == pytest.approx(11 * 2.03e-3 + 1.28e-3, rel=1e-12)
    # On a CUDA device of 4 GiB at gpu_memory_utilization=0.486 the engine has 0.486 x 4 x 2^30
    # = 2087354105.9 bytes, 87354105.9 after the weights: the cache of 5 sequences at their
    # longest (5 x 1e6 x 16 tokens = 8e7), not 6 (9.6e7); max_num_seqs=256 no longer binds,
    # and the 32 tokens take ceil(32 / 5) = 7 steps.
    cuda = load([*base, "rollout.max_num_seqs=256", "cluster.device=cuda", "cluster.memory_gb=4",
                 "rollout.gpu_memory_utilization=0.486"], engine_check=False)
    g = generation(cuda, PARAMS, WEIGHTS, KV)
    assert (g.concurrent, g.steps) == (5, 7)


def test_the_transfer_is_the_busiest_actor_rank_s_weights_over_its_links():
    from rlhf_paro.plan import transfer_seconds

    cfg = load([*SMALL, "cluster.num_devices=2", "cluster.group_size=2", "rollout.num_devices=4",
                "cluster.intra_gbps=100", "cluster.inter_gbps=10"])
    # Training ranks 0, 1 on node 0; replicas 0-3 on devices 2-5, nodes 1 and 2. Rank 0 serves
    # replicas 0 and 2 (j mod 2), rank 1 replicas 1 and 3: each sends the weights twice over
    # inter links, 2 x 2e9 / 10e9 = 0.4 s.
    assert transfer_seconds(cfg, WEIGHTS) == (0, 2 * WEIGHTS, pytest.approx(0.4, rel=1e-12))
    # On nodes of 4 (a split of 8 devices, training on 2), replicas 0 and 1 (devices 2 and 3)
    # share node 0 with the training ranks: rank 0 sends once intra, once inter (replica 2 on
    # device 4), 2e9 / 100e9 + 2e9 / 10e9 = 0.22 s.
    assert transfer_seconds(cfg, WEIGHTS, node_size=4) == (
        WEIGHTS, WEIGHTS, pytest.approx(0.22, rel=1e-12))


def test_the_step_follows_the_pipeline_s_order_synchronous_adds_k_steps_off_overlaps():
    from rlhf_paro.plan import generation, predict_step, transfer_seconds

    cfg = load([*SMALL, "rollout.num_devices=2", "rollout.max_staleness=1"])
    plan = make_plan(cfg, vocab_sizes=VOCAB)
    actor = plan.models["actor"]
    overlapped, synchronous = predict_step(cfg, plan), predict_step(cfg, plan, 0)
    gen = generation(cfg, actor.num_params, actor.engine_weights, actor.kv_token_bytes).seconds
    gather = actor.gather[plan.best["actor"].strategy.params]
    # The actor's fp32 weights (4 bytes each) to the 2 replicas, each served by its own rank
    # across nodes (ppo_tiny: nodes of 2, 4 training devices).
    transfer = actor.num_params * 4 / (cfg.cluster.inter_gbps * 1e9)
    assert transfer_seconds(cfg, actor.engine_weights)[2] == pytest.approx(transfer, rel=1e-12)
    train = sum(c.seconds for c in plan.best.values()) - gather
    # Sums of a handful of floats: a few ulps apart at most.
    assert overlapped.order == "1 step off" and synchronous.order == "synchronous"
    assert overlapped.seconds == pytest.approx(gather + transfer + max(gen, train), rel=1e-12)
    assert synchronous.seconds == pytest.approx(gather + transfer + gen + train, rel=1e-12)
    assert overlapped.seconds < synchronous.seconds


def test_rollout_devices_take_the_engine_off_the_training_devices_for_strategy_auto():
    # [Note: the rollout on devices of its own] vLLM's share at gpu_memory_utilization=0.6 of
    # 80 GiB is 48 GiB: with the four 7B models' states beside it on each of the 16 devices
    # nothing fits; on 8 devices of its own, the 16 training devices hold only the models, and
    # auto chooses as without an engine (the conf's NGG, NII, I, N).
    from rlhf_paro.plan import choose_strategies

    share = ["conf=ppo_llama7b", "rollout.engine=vllm", "rollout.gpu_memory_utilization=0.6",
             "actor.strategy=auto"]
    colocated = load(share, engine_check=False)
    with pytest.raises(ConfigError, match="actor.strategy: auto found no strategy"):
        choose_strategies(colocated)
    apart = load([*share, "rollout.num_devices=8"], engine_check=False)
    plan = make_plan(apart)
    assert plan.models["actor"].engine_bytes == 0
    assert choose_strategies(apart) == {"actor": Strategy.parse("NGG"),
                                        "critic": Strategy.parse("NII"),
                                        "reward": Strategy.parse("I", frozen=True),
                                        "ref": Strategy.parse("N", frozen=True)}


def test_the_table_splits_the_devices_every_way_the_conf_runs(capsys):
    from rlhf_paro.plan import rollout_splits

    cfg = load(SMALL)
    rows, skipped = rollout_splits(cfg, VOCAB)
    # 4 devices: D = 0 (colocated), 2 (2 + 2), and not 1 or 3 (8 prompts over 3 devices).
    assert [(r.rollout_devices, r.training_devices) for r in rows] == [(0, 4), (2, 2)]
    assert set(skipped) == {1, 3}
    assert skipped[1].startswith("ppo.rollout_batch_size: 8 must be a multiple of "
                                 "cluster.num_devices=3")
    colocated, apart = rows
    assert colocated.overlapped is None and colocated.synchronous.transfer == 0
    # D = 2 on 2 training devices of nodes of 2: the replicas sit on node 1, inter links.
    assert apart.synchronous.transfer > 0
    assert apart.overlapped.seconds == pytest.approx(
        apart.synchronous.sync + max(apart.synchronous.generate, apart.synchronous.train),
        rel=1e-12)
    main(SMALL)
    out = capsys.readouterr().out
    assert "step (synchronous, rollout.max_staleness=0): sync " in out
    assert "devices for the rollout, of 4" in out and "  D=1, 3: not runnable" in out


def test_llama7b_generation_reads_its_weights_and_as_much_cache_every_decoding_step(llama,
                                                                                    llama_plan):
    from rlhf_paro.plan import generation, predict_step

    actor = llama_plan.models["actor"]
    # bf16 weights: 2 x Psi bytes; a token's cache: a key and a value of 4096 in each of 32
    # layers, 2 x 32 x 4096 x 2 = 524288 bytes (0.5 MiB).
    assert (actor.engine_weights, actor.kv_token_bytes) == (2 * PSI, 524_288)
    g = generation(llama, actor.num_params, actor.engine_weights, actor.kv_token_bytes)
    # hf on the 16 devices: 64 sequences each, 16 prompts at a time (rollout.micro_batch_size,
    # n = 1), 4 batches of 1024 steps. A step reads 13476831232 bytes of weights and 16
    # sequences' cache at 1024 + 1024 / 2 tokens, 16 x 524288 x 1536 = 12884901888 bytes: at
    # 1500 GB/s, 17.5745 ms; its FLOPs, 2 x Psi x 16 at 150 TFLOP/s, 1.44 ms. Prefill: 64 x 1024
    # prompt tokens x 2 x Psi / 150e12 = 5.8881 s. In all 4096 x 17.5745 ms + 5.8881 s = 77.87 s.
    assert (g.sequences, g.concurrent, g.steps, g.memory_bound) == (64, 16, 4096, True)
    step = (2 * PSI + 12_884_901_888) / 1.5e12
    prefill = 2 * PSI * 64 * 1024 / 150e12
    assert g.seconds == pytest.approx(4096 * step + prefill, rel=1e-12)
    # Synchronous: the conf's NGG actor gathers nothing (P = N), so the step adds generation to
    # the four models' 142.1 s (the recommended combination's sum).
    s = predict_step(llama, llama_plan)
    assert s.sync == 0 and s.seconds == pytest.approx(
        g.seconds + sum(c.seconds for c in llama_plan.best.values()), rel=1e-12)
