"""Conf loading, overrides and the one-line errors of every kind of user mistake."""

import subprocess
import sys

import pytest

from rlhf_paro.compose import CONF_DIR, available_confs, load_config, split_sweep
from rlhf_paro.config import AlgorithmConfig, ConfigError, build_config, cli_errors
from rlhf_paro.resolve import resolve
from rlhf_paro.rollout import vllm as vllm_engine
from rlhf_paro.rollout.hf import HFRollout
from rlhf_paro.rollout.vllm import VLLMRollout
from tests.confs import INLINE, load


def error_of(argv):
    """The one-line error of ``argv``, composed and resolved as an entry point does."""
    with pytest.raises(ConfigError) as info:
        load(argv)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_default_conf_is_ppo_tiny_with_four_strategies_on_two_groups_of_two():
    cfg = load_config([])
    assert (cfg.cluster.num_devices, cfg.cluster.group_size, cfg.cluster.num_groups) == (4, 2, 2)
    assert [cfg.model(r).strategy for r in ("actor", "critic", "reward", "ref")] == \
        ["IGG", "NIG", "I", "G"]
    # ref names no model: resolving makes it the actor's (the demo's SFT), and the critic the
    # reward model's, since the algorithm (gae) trains one.
    assert cfg.ref.path is None and cfg.critic.path is None
    resolved = resolve(cfg)
    assert resolved.ref.path == resolved.actor.path and resolved.critic.path == resolved.reward.path
    assert resolve(resolved) == resolved  # once is enough; again changes nothing
    inline = load(INLINE)  # without paths, the inline config is inherited, as a copy
    assert inline.ref.config == inline.actor.config and inline.ref.config is not inline.actor.config
    assert inline.critic.config == inline.actor.config == inline.reward.config
    assert inline.critic.config is not inline.actor.config
    # 32 sequences per step / 4 devices / 4 per micro-batch = 2 micro-batches.
    assert cfg.grad_accum_steps("actor") == 2


def test_overrides_parse_as_yaml_and_normalise_strategies():
    cfg = load_config(["actor.strategy=zero3", "critic.strategy=mics", "ref.strategy=NNG",
                       "comm.algorithm=horing", "ppo.rollout_batch_size=128",
                       "actor.optim.betas=[0.8, 0.9]", "actor.config.hidden_size=32",
                       "logger.wandb.name=7", "trainer.seed=3", "critic.optim.lr=5e-3"])
    assert (cfg.actor.strategy, cfg.critic.strategy, cfg.ref.strategy) == ("GGG", "III", "N")
    assert cfg.comm.algorithm == "horing"
    assert cfg.ppo.rollout_batch_size == 128
    assert cfg.actor.optim.betas == (0.8, 0.9)
    assert cfg.actor.config["hidden_size"] == 32 and resolve(cfg).ref.config["hidden_size"] == 32
    assert cfg.logger.wandb.name == "7"
    assert cfg.critic.optim.lr == 5e-3  # a number, as OmegaConf reads it (YAML 1.1: a string)
    assert load_config(["actor.strategy=auto"]).actor.strategy == "auto"
    assert load_config(["comm.algorithm=auto"]).comm.algorithm == "auto"


def test_ppo_tiny_gives_the_values_of_the_default_run():
    # The values the hand-written loader gave before configs moved onto OmegaConf.
    cfg = load_config(["conf=ppo_tiny"])
    assert cfg.task.model == {"model_type": "llama", "hidden_size": 64,
                                "intermediate_size": 128, "num_hidden_layers": 2,
                                "num_attention_heads": 2, "num_key_value_heads": 2,
                                "max_position_embeddings": 64}
    assert (cfg.actor.optim.lr, cfg.actor.optim.betas, cfg.critic.optim.lr) == \
        (1e-3, (0.9, 0.95), 3e-3)
    assert (cfg.actor.micro_batch_size, cfg.reward.micro_batch_size, cfg.actor.lora.r) == (4, 8, 8)
    assert (cfg.ppo.rollout_batch_size, cfg.ppo.mini_batch_size, cfg.ppo.ppo_epochs) == (64, 32, 2)
    assert (cfg.algorithm.kl_coef, cfg.algorithm.adaptive_kl, cfg.data.max_prompt_length) == \
        (0.01, False, 56)
    assert (cfg.trainer.steps, cfg.trainer.seed, cfg.trainer.output_dir) == \
        (50, 0, "outputs/ppo_tiny")
    assert (cfg.cluster.device, cfg.cluster.memory_gb, cfg.comm.algorithm) == ("cpu", None, "auto")
    assert (cfg.task.reward_lr, cfg.logger.wandb.mode, cfg.ray.address) == (1e-3, "offline", None)


def test_llama7b_builds_on_ppo_tiny():
    assert (CONF_DIR / "ppo_llama7b.yaml").read_text().count("\ndefaults: [ppo_tiny]\n") == 1
    tiny, llama = load_config(["conf=ppo_tiny"]), load_config(["conf=ppo_llama7b"])
    assert (llama.cluster.num_devices, llama.cluster.group_size) == (16, 8)
    assert llama.actor.config["hidden_size"] == 4096 and llama.actor.optim.lr == 5e-7
    assert (llama.actor.optim.betas, llama.algorithm.kl_coef, llama.ppo.lam) == \
        (tiny.actor.optim.betas, tiny.algorithm.kl_coef, tiny.ppo.lam)  # from ppo_tiny
    assert (llama.ppo.mini_batch_size, llama.trainer.steps, llama.ray.address) == \
        (512, 1000, "auto")


def test_add_delete_and_interpolate():
    cfg = load_config([*INLINE, "+actor.config.rms_norm_eps=1e-5",
                       "~actor.config.num_key_value_heads",
                       "~algorithm.kl_coef", "ppo.mini_batch_size=${ppo.rollout_batch_size}",
                       "trainer.output_dir=runs/seed${trainer.seed}", "trainer.seed=3"])
    assert cfg.actor.config["rms_norm_eps"] == 1e-5
    assert "num_key_value_heads" not in cfg.actor.config
    assert cfg.algorithm.kl_coef == AlgorithmConfig.kl_coef  # the schema's default, not ppo_tiny's 0.01
    assert cfg.ppo.mini_batch_size == 64
    assert cfg.trainer.output_dir == "runs/seed3"  # resolved after every override


def test_sweeps_split_at_top_level_commas_only():
    assert split_sweep("k", "a,[b, c],{d: 1, e: 2},'f,g'") == ["a", "[b, c]", "{d: 1, e: 2}",
                                                              "'f,g'"]
    assert split_sweep("k", "IGG") == ["IGG"]


def test_conf_by_path_with_defaults_merged_first(tmp_path):
    (tmp_path / "base.yaml").write_text(
        "cluster: {num_devices: 8, group_size: 4}\ntrainer: {steps: 5, seed: 1}\n"
        "actor: {config: {hidden_size: 16}, strategy: GGG}\n"
        "ppo: {rollout_batch_size: 64, mini_batch_size: 32}\n")
    (tmp_path / "run.yaml").write_text(
        "defaults: [base]\ntrainer: {steps: 7, output_dir: 'runs/seed${trainer.seed}'}\n")
    cfg = load_config([f"conf={tmp_path / 'run.yaml'}", "cluster.group_size=2"])
    assert (cfg.trainer.steps, cfg.trainer.seed) == (7, 1)  # merged key by key
    assert cfg.trainer.output_dir == "runs/seed1"
    assert (cfg.cluster.num_devices, cfg.cluster.group_size) == (8, 2)
    (tmp_path / "loop.yaml").write_text("defaults: [loop]\n")
    assert "includes itself" in error_of([f"conf={tmp_path / 'loop.yaml'}"])


def test_nodes_and_gpus_per_node_define_the_cluster():
    cfg = build_config({"actor": {"config": {}}, "cluster": {"nodes": 16, "gpus_per_node": 8},
                        "ppo": {"rollout_batch_size": 512, "mini_batch_size": 512}})
    assert (cfg.cluster.num_devices, cfg.cluster.group_size) == (128, 8)
    with pytest.raises(ConfigError, match="cluster.num_devices: 4 disagrees"):
        build_config({"actor": {"config": {}},
                      "cluster": {"num_devices": 4, "nodes": 2, "gpus_per_node": 8}})


@pytest.mark.parametrize("argv, key, allowed", [
    (["acter.strategy=IGG"], "acter", "did you mean actor?"),
    (["actor.optimizer.lr=1"], "actor.optimizer", "allowed: path, config, strategy"),
    (["actor.micro_batch_size=abc"], "actor.micro_batch_size", "expected an integer"),
    (["actor.micro_batch_size=true"], "actor.micro_batch_size", "expected an integer"),
    (["actor.optim.lr=fast"], "actor.optim.lr", "expected a number"),
    (["actor.max_tokens_per_micro_batch=0"], "actor.max_tokens_per_micro_batch",
     "must be positive"),
    (["critic.max_tokens_per_micro_batch=63"], "critic.max_tokens_per_micro_batch",
     "smaller than the longest sequence a step can hold, 64 tokens (data.max_prompt_length=56 "
     "+ ppo.max_new_tokens=8); allowed: null or at least 64"),
    (["ref.max_tokens_per_micro_batch=64"], "ref.max_tokens_per_micro_batch", "allowed: null"),
    (["actor.backend=deepspeed", "actor.max_tokens_per_micro_batch=64"],
     "actor.max_tokens_per_micro_batch", "allowed: null on backend=deepspeed"),
    (["actor.gradient_checkpointing=2"], "actor.gradient_checkpointing", "true or false"),
    (["actor.precision=fp16"], "actor.precision", "allowed: fp32, bf16"),
    (["comm.algorithm=tree"], "comm.algorithm", "allowed: auto, native, ring, hring, horing"),
    (["comm.algorithm=Auto"], "comm.algorithm", "allowed: auto, native"),
    (["actor.strategy=XYZ"], "actor.strategy", "a triple of N/I/G"),
    (["actor.strategy=GNN"], "actor.strategy", "nearest valid strategy: GNG"),
    (["critic.strategy=N"], "critic.strategy", "a trained model needs"),
    (["ref.strategy=Q"], "ref.strategy", "N, I, G"),
    (["cluster.group_size=3"], "cluster.group_size", "allowed: 1, 2, 4"),
    (["ppo.rollout_batch_size=-4"], "ppo.rollout_batch_size", "must be positive"),
    (["ppo.mini_batch_size=0"], "ppo.mini_batch_size", "must be positive"),
    (["ppo.mini_batch_size=24"], "ppo.mini_batch_size",
     "must divide the samples of a step, ppo.rollout_batch_size x rollout.n = 64"),
    (["actor.micro_batch_size=16"], "ppo.mini_batch_size", "actor.micro_batch_size"),
    (["ppo.rollout_batch_size=66", "ppo.mini_batch_size=66"], "ppo.rollout_batch_size",
     "multiple of cluster.num_devices"),
    (["ppo.lam=1.5"], "ppo.lam", "[0, 1]"),
    (["rollout.micro_batch_size=0"], "rollout.micro_batch_size", "must be >= 1 or null"),
    (["rollout.engine=sglang"], "rollout.engine", "allowed: hf"),
    (["rollout.gpu_memory_utilization=half"], "rollout.gpu_memory_utilization",
     "got 'half'; allowed: auto or a number"),
    (["rollout.gpu_memory_utilization=0"], "rollout.gpu_memory_utilization",
     "must be in (0, 1] or auto, got 0"),
    (["rollout.streaming=maybe"], "rollout.streaming", "got 'maybe'; allowed: auto or true or "
                                                       "false"),
    (["rollout.tis_cap=0"], "rollout.tis_cap", "must be > 0 or null (off), got 0"),
    (["rollout.tis_cap=-2.5"], "rollout.tis_cap", "must be > 0 or null (off), got -2.5"),
    (["rollout.mask=product", "rollout.mask_high=2"], "rollout.mask",
     "got 'product'; allowed: null, sequence, geometric"),
    (["rollout.mask=sequence"], "rollout.mask_high", "needs the band's upper bound"),
    (["rollout.mask=sequence", "rollout.mask_high=0"], "rollout.mask_high", "must be > 0"),
    (["rollout.mask=geometric", "rollout.mask_low=-0.5", "rollout.mask_high=1.01"],
     "rollout.mask_low", "must be > 0 (a ratio of probabilities), got -0.5"),
    # Empty bands: the bounds the wrong way round, or mask_high <= 1 with mask_low its inverse.
    (["rollout.mask=geometric", "rollout.mask_low=1.01", "rollout.mask_high=0.99"],
     "rollout.mask_low", "the band [1.01, 0.99] (mask_low=1.01) keeps no sample"),
    (["rollout.mask=sequence", "rollout.mask_high=1"], "rollout.mask_high",
     "the band [1, 1] (mask_low null, 1 / mask_high = 1) keeps no sample"),
    (["rollout.mask_high=2"], "rollout.mask_high", "bounds no mask"),
    (["rollout.geo_mask_high=1.01"], "rollout.geo_mask_high", "did you mean rollout.mask_high?"),
    (["trainer.save_every=-1"], "trainer.save_every", "must be >= 0"),
    (["trainer.max_skipped_steps=-2"], "trainer.max_skipped_steps", "must be >= 0"),
    (["trainer.resume=/no/such/step_3"], "trainer.resume", "auto, none or a checkpoint"),
    (["ref.lora.enabled=true"], "ref.lora.enabled", "actor and critic"),
    (["ref.offload=optimizer"], "ref.offload", "no optimizer state; allowed: none, params"),
    (["reward.offload=optimizer"], "reward.offload", "allowed: none, params"),
    (["actor.offload=params"], "actor.offload", "allowed: none, optimizer"),
    (["critic.offload=cpu"], "critic.offload", "allowed: none, optimizer, params"),
    (["conf=no_such_conf"], "conf", "ppo_tiny"),
    # A path on the command line replaces the conf's inline config; both given is a mistake.
    (["actor.path=/no/such/model"], "actor.path", "never downloaded"),
    (["actor.path=/no/such/model", "actor.config={hidden_size: 8}"], "actor.path", "not both"),
    (["actor.config=null", "actor.path=/no/such/model"], "actor.path", "never downloaded"),
    (["actor.config=null"], "actor", "actor.path"),
    (["ppo.gamma"], "ppo.gamma", "key=value"),
    (["data.max_prompt_length=3"], "task.prompt_len", "exceeds data.max_prompt_length=3"),
    # Two prompt-length keys were one too many: ppo.max_prompt_len bounded the task's prompts,
    # data.max_prompt_length the files'. The one left is named.
    (["ppo.max_prompt_len=8"], "ppo.max_prompt_len",
     "is gone: data.max_prompt_length is the one key for it; allowed: data.max_prompt_length"),
    (["ppo.max_prompt_length=8"], "ppo.max_prompt_length", "allowed: data.max_prompt_length"),
    (["cluster=4"], "cluster", "expected a section"),
    (["cluster.num_devices.x=1"], "cluster.num_devices", "not a section"),
    (["+actor.strategy=IGG"], "actor.strategy", "allowed: actor.strategy=VALUE"),
    (["+actor.nosuch=1"], "actor.nosuch", "unknown key"),
    ([*INLINE, "+actor.config.hidden_size=3"], "actor.config.hidden_size", "already set to 64"),
    (["~acter"], "acter", "did you mean actor?"),
    (["~actor.config.nope"], "actor.config.nope", "nothing to delete"),
    (["~actor.strategy=IGG"], "actor.strategy", "allowed: ~actor.strategy"),
    (["actor.strategy=IGG,NNG"], "actor.strategy", "-m to run one job per value"),
    (["trainer.output_dir=${nosuch.key}"], "trainer.output_dir", "'nosuch.key' not found"),
    (["trainer.output_dir=${oops"], "trainer.output_dir", "allowed: ${key}"),
    (["actor.optim.lr=.nan"], "actor.optim.lr", "got nan; allowed: a finite number"),
    (["actor.config.a\nb=1", "actor.strategy=Q"], "actor.strategy", "unknown strategy"),
    (["actor.backend=ds"], "actor.backend", "allowed: paro, deepspeed"),
    (["actor.deepspeed.zero_stage=4"], "actor.deepspeed.zero_stage", "allowed: 0, 1, 2, 3"),
    (["actor.deepspeed.zero_stage=2", "actor.deepspeed.hpz_partition_size=2"],
     "actor.deepspeed.hpz_partition_size", "needs zero_stage=3"),
    (["actor.deepspeed.zero_stage=0", "actor.deepspeed.offload_optimizer=true"],
     "actor.deepspeed.offload_optimizer", "zero_stage 1, 2 or 3"),
    (["actor.backend=deepspeed", "actor.deepspeed.hpz_partition_size=3"],
     "actor.deepspeed.hpz_partition_size", "must divide cluster.num_devices=4"),
    (["ref.backend=deepspeed", "ref.deepspeed.hpz_partition_size=2"],
     "ref.deepspeed.hpz_partition_size", "only for trained models"),
    (["critic.backend=deepspeed", "critic.offload=optimizer"], "critic.offload",
     "critic.deepspeed.offload_optimizer"),
    (["reward.backend=deepspeed", "reward.deepspeed.offload_optimizer=true"],
     "reward.deepspeed.offload_optimizer", "no optimizer"),
])
def test_every_mistake_is_one_line_naming_the_key(argv, key, allowed):
    message = error_of(argv)
    assert message.startswith(f"{key}: ") or message.startswith(f"{key} "), message
    assert allowed in message


@pytest.mark.parametrize("engine, setting, streams", [
    ("vllm", None, True), ("hf", None, False), ("hf", "true", True), ("vllm", "false", False),
    ("hf", "false", False), ("vllm", "auto", True)])
def test_episodes_stream_on_vllm_by_default_and_on_hf_when_asked(engine, setting, streams):
    if engine == "vllm" and not vllm_engine.installed():  # the config checks the engine's import
        pytest.skip('needs the vllm extra: pip install -e ".[vllm]"')
    argv = [f"rollout.engine={engine}"] + ([f"rollout.streaming={setting}"] if setting else [])
    own = {"hf": HFRollout, "vllm": VLLMRollout}[engine].streams_by_default  # auto's answer
    assert load(argv).rollout.streams(own) is streams


def test_the_mask_s_band_is_off_by_default_and_its_lower_bound_is_the_upper_s_inverse():
    assert load([]).rollout.mask is None
    assert load(["rollout.mask=geometric", "rollout.mask_high=1.25"]).rollout.mask_band == \
        (0.8, 1.25)
    assert load(["rollout.mask=sequence", "rollout.mask_low=0.25", "rollout.mask_high=2"]
                ).rollout.mask_band == (0.25, 2.0)


def test_the_engine_s_share_is_auto_by_default_or_a_number():
    assert load([]).rollout.gpu_memory_utilization == "auto"
    assert load(["rollout.gpu_memory_utilization=0.5"]).rollout.gpu_memory_utilization == 0.5
    assert load(["rollout.gpu_memory_utilization=1"]).rollout.gpu_memory_utilization == 1


@pytest.mark.parametrize("argv, key, allowed", [
    # A token for no server: silently ignored before.
    (["reward.token_env=REWARD_TOKEN"], "reward.token_env", "allowed: with url, or null"),
    (["ray.placement_timeout_s=0"], "ray.placement_timeout_s", "positive number of seconds or "
                                                               "null (no limit), got 0"),
    (["ray.placement_timeout_s=.inf"], "ray.placement_timeout_s", "got inf"),
])
def test_keys_of_a_run_s_surroundings_are_checked_in_one_line(argv, key, allowed):
    message = error_of(argv)
    assert message.startswith(f"{key}: ") and allowed in message, message


def test_a_deepspeed_model_takes_its_stage_equivalent_strategy():
    cfg = load(["actor.backend=deepspeed", "actor.deepspeed.zero_stage=3",
                       "actor.deepspeed.hpz_partition_size=2", "critic.backend=deepspeed",
                       "critic.deepspeed.zero_stage=1", "ref.backend=deepspeed",
                       "reward.backend=deepspeed", "reward.deepspeed.zero_stage=2"])
    assert (cfg.actor.strategy, cfg.critic.strategy, cfg.ref.strategy, cfg.reward.strategy) == (
        "IGG", "NNG", "G", "N")
    assert load(["actor.deepspeed.zero_stage=1"]).actor.strategy != "NNG"  # paro: as set


def test_cli_errors_exit_2_with_only_the_message(capsys):
    with pytest.raises(SystemExit) as info:
        with cli_errors():
            load_config(["actor.strategy=XYZ"])
    assert info.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("error: actor.strategy: unknown strategy 'XYZ'")
    assert err.count("\n") == 1


def test_shipped_confs_all_load():
    assert {"ppo_tiny", "ppo_llama7b"} <= set(available_confs())


@pytest.mark.parametrize("module", ["rlhf_paro.config", "rlhf_paro.compose"])
def test_config_imports_without_torch_the_ppo_layer_or_a_demo_resolver(module):
    # A bad command line must fail in a fraction of a second, before torch's import (seconds);
    # the schema and composition sit below ppo (tests/test_layers.py) and make nothing, so the
    # entry points, not they, register ${demo:NAME}.
    code = (f"import sys, {module}\nfrom omegaconf import OmegaConf\n"
            "loaded = [m for m in sys.modules if m == 'torch' or m.startswith('rlhf_paro.ppo')]\n"
            "assert not loaded, loaded\nassert not OmegaConf.has_resolver('demo')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_composing_reads_no_file_but_the_confs_and_resolving_checks_them(tmp_path):
    # Files a config names are resolve's to check: composing a missing model, prompt file,
    # tokenizer, function or checkpoint builds, and resolving it is the one-line error.
    cases = [(["actor.path=/no/such/model"], "actor.path", "never downloaded"),
             (["actor.tokenizer=/no/such/dir"], "actor.tokenizer", "no directory"),
             ([f"reward.function={tmp_path}/none.py:f"], "reward.function", "no file"),
             ([f"data.train_files={tmp_path}/none.jsonl"], "data.train_files", "no file"),
             (["data.train_files=prompts.csv"], "data.train_files", "not a data file"),
             (["trainer.resume=/no/such/step_3"], "trainer.resume", "no complete checkpoint")]
    for argv, key, problem in cases:
        cfg = load_config(argv)
        with pytest.raises(ConfigError) as info:
            resolve(cfg)
        assert str(info.value).startswith(f"{key}: ") and problem in str(info.value), argv
    # A reward server's token: the environment is read by resolve, not by the schema.
    server = ["reward.path=null", "reward.url=http://127.0.0.1:1/score",
              "reward.token_env=RLHF_PARO_NO_SUCH_TOKEN"]
    with pytest.raises(ConfigError, match="reward.token_env: the environment variable"):
        resolve(load_config(server))


def test_the_schema_rewrites_no_sibling_section():
    # Building a config sets nothing from another section: ref, reward and critic keep no source
    # and a DeepSpeed model keeps the strategy it was given, until resolve.
    inline = {"hidden_size": 8, "num_attention_heads": 2}
    cfg = build_config({"actor": {"config": inline},
                        "critic": {"backend": "deepspeed", "strategy": "auto"}})
    assert [cfg.model(r).config for r in ("critic", "reward", "ref")] == [None, None, None]
    assert cfg.critic.strategy == "auto"
    resolved = resolve(cfg, say=lambda _: None)
    assert resolved.ref.config == resolved.reward.config == inline
    assert resolved.critic.strategy == "GGG" and cfg.critic.strategy == "auto"  # input untouched


def test_the_driver_deals_rollouts_only_with_balance_batch_and_more_than_one_device():
    # One rank has no other to wait for: dealing would only add the driver's round trip.
    four, one = INLINE, [*INLINE, "cluster.num_devices=1", "cluster.group_size=1"]
    assert load(four).deals_rollouts
    assert not load([*four, "ppo.balance_batch=false"]).deals_rollouts
    assert not load(one).deals_rollouts


@pytest.mark.parametrize("argv, estimator", [
    ([], "k1"),  # the penalty in the reward
    (["algorithm.kl_in_loss=true"], "k3"),  # the loss term
    (["algorithm.kl_in_loss=true", "algorithm.kl_estimator=k2"], "k2"),  # the user's, kept
    (["algorithm.kl_estimator=k3"], "k3"),
])
def test_the_kl_estimator_goes_by_where_the_kl_goes_unless_set(argv, estimator):
    # The schema leaves it unset (null) until resolve: whether the user set it is knowable.
    assert AlgorithmConfig().kl_estimator is None
    assert resolve(load_config([*INLINE, *argv])).algorithm.kl_estimator == estimator


def test_every_path_a_run_names_is_absolute_from_where_the_command_was_typed(tmp_path,
                                                                             monkeypatch):
    # The workers do not start in the driver's directory (on a joined cluster: the raylet's),
    # so a relative path reached them as another file: `actor.path=my/policy` found no
    # tokenizer there, and a run's checkpoints landed under the raylet's directory.
    from tests.hf_assets import bpe_tokenizer, save_llama, write_prompts, write_reward_functions

    monkeypatch.chdir(tmp_path)
    save_llama(tmp_path / "my" / "policy", bpe_tokenizer())
    write_prompts(tmp_path / "prompts.jsonl", 4)
    write_reward_functions(tmp_path / "rewards.py")
    cfg = load(["actor.path=my/policy", "data.train_files=prompts.jsonl,./prompts.jsonl",
                "reward.function=rewards.py:length", "trainer.output_dir=outputs/mine",
                "task.cache_dir=cache"])
    there = str(tmp_path)
    assert (cfg.actor.path, cfg.ref.path, cfg.critic.path) == (f"{there}/my/policy",) * 3
    assert cfg.data.train_files == f"{there}/prompts.jsonl,{there}/prompts.jsonl"
    assert cfg.reward.function == f"{there}/rewards.py:length"
    assert (cfg.trainer.output_dir, cfg.task.cache_dir) == (f"{there}/outputs/mine",
                                                            f"{there}/cache")
    assert cfg.trainer.resume == "auto"  # a choice, not a path
    assert load_config(["trainer.output_dir=outputs/mine"]).trainer.output_dir == "outputs/mine"
