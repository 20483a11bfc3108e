"""Where a worker's gloo binds: the interface of its Ray node's address, so that ranks on other
nodes reach it there (a hostname that resolves to loopback would send them to their own)."""

from __future__ import annotations

import os

import psutil
import pytest

from rlhf_paro.actors.worker import bind_gloo, interface_of
from tests.confs import INLINE


def _some_ipv4_interface() -> tuple[str, str]:
    for name, addresses in psutil.net_if_addrs().items():
        for a in addresses:
            if a.family.name == "AF_INET":
                return name, a.address
    pytest.skip("no interface with an IPv4 address")


def test_interface_of_an_address_is_the_one_that_holds_it_and_none_for_a_foreign_one():
    name, address = _some_ipv4_interface()
    assert interface_of(address) == name
    assert interface_of("203.0.113.77") is None  # TEST-NET-3: never a local address here


def test_gloo_binds_to_the_interface_of_the_node_address(monkeypatch):
    name, address = _some_ipv4_interface()
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    bind_gloo(address)
    assert os.environ["GLOO_SOCKET_IFNAME"] == name


def test_gloo_keeps_the_interface_a_user_named_and_defaults_for_an_unknown_address(monkeypatch):
    _, address = _some_ipv4_interface()
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "ib0")
    bind_gloo(address)
    assert os.environ["GLOO_SOCKET_IFNAME"] == "ib0"
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    bind_gloo("203.0.113.77")  # gloo's own default stays (the hostname's address)
    assert "GLOO_SOCKET_IFNAME" not in os.environ


def test_engine_options_carry_a_trained_models_step_and_each_backends_own_keys():
    from rlhf_paro.actors.worker import engine_options
    from tests.confs import INLINE, load

    cfg = load([*INLINE, "actor.optim.lr=3e-6", "actor.optim.max_grad_norm=0.5",
                       "actor.reduce_dtype=bf16", "comm.algorithm=ring",
                       "critic.backend=deepspeed", "critic.deepspeed.zero_stage=2",
                       "+critic.deepspeed.config.wall_clock_breakdown=true"])
    actor = engine_options(cfg, "actor", trained=True, device="cpu")
    assert (actor.backend, actor.model_name, actor.frozen, actor.strategy, actor.comm) == \
        ("paro", "actor", False, cfg.actor.strategy, "ring")
    assert actor.optim == cfg.actor.optim.adamw() and actor.optim["lr"] == 3e-6
    assert (actor.max_grad_norm, actor.reduce_dtype, actor.grad_accum_steps) == \
        (0.5, "bf16", cfg.grad_accum_steps("actor"))
    critic = engine_options(cfg, "critic", trained=True)
    assert (critic.backend, critic.zero_stage, critic.deepspeed_config) == \
        ("deepspeed", 2, {"wall_clock_breakdown": True})
    # A frozen model gets no optimizer, whatever its section says.
    ref = engine_options(cfg, "ref", trained=False)
    assert ref.frozen and ref.optim is None and ref.max_grad_norm is None
    assert (ref.grad_accum_steps, ref.reduce_dtype) == (1, "fp32")


@pytest.mark.parametrize("packed, computed", [(True, 5), (False, 8)])
def test_a_forward_counts_the_positions_it_computes_on_and_the_real_tokens(packed, computed):
    import torch

    from rlhf_paro.actors.worker import Worker

    worker = object.__new__(Worker)  # the counters only: no process group, no model
    worker.packed, worker._tokens, worker._real_tokens = packed, 0, 0
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]])  # 5 real tokens in 8 positions
    worker.count_tokens(mask)
    assert (worker._tokens, worker._real_tokens) == (computed, 5)
    worker.count_tokens(mask, packed=False)  # generation runs padded on any model
    assert (worker._tokens, worker._real_tokens) == (computed + 8, 10)


@pytest.mark.parametrize("engine, computed", [("hf", 8), ("vllm", 5)])
def test_generation_counts_the_positions_its_engine_computes_on(engine, computed):
    # hf's static batch computes on every position of the rows; vLLM's continuous batch on the
    # real tokens only: perf/padding_fraction counts no padding it never computed.
    from collections import defaultdict

    import torch

    from rlhf_paro.actors.actor import ActorWorker
    from rlhf_paro.actors.rollout import Generation
    from rlhf_paro.rollout import PromptBatch, RolloutBatch
    from rlhf_paro.rollout.hf import HFRollout
    from rlhf_paro.rollout.vllm import VLLMRollout
    from tests.confs import INLINE, load

    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]])  # 5 real tokens in 8 positions
    batch = RolloutBatch(mask.clone(), mask, torch.ones(2, 2))

    class Engine:  # the registered engine's answers, without its model
        computes_padding = {"hf": HFRollout, "vllm": VLLMRollout}[engine].computes_padding
        needs_sync = takes_requests = False

        def generate(self, prompts, sampling):
            return batch

        def wake(self):
            pass

        def sleep(self):
            pass

    worker = object.__new__(ActorWorker)  # the counters only: no process group, no model
    worker.cfg, worker._engine_stale = load(INLINE), False
    worker.generation = Generation(worker.cfg, Engine(), None, torch.device("cpu"))
    worker.rank = 0
    worker.packed, worker._tokens, worker._real_tokens = True, 0, 0
    worker._time_s, worker._threads = defaultdict(float), {}
    worker.generate(PromptBatch(mask, mask))
    assert (worker._tokens, worker._real_tokens) == (computed, 5)


@pytest.mark.parametrize("argv, cores, expected", [
    # GRPO with a reward function on one device of 2 cores: the actor generates and trains on
    # both; its old log-probs and the reference's share them.
    (["conf=grpo_tiny", "cluster.num_devices=1", "cluster.group_size=1"], 2,
     {"actor": {"generate": 2, "sync": 2, "inference": 1, "train": 2}, "ref": {"inference": 1}}),
    # PPO's four models on one device of 8 cores: four forwards at once, two updates at once.
    ([*INLINE, "cluster.num_devices=1", "cluster.group_size=1"], 8,
     {"actor": {"generate": 8, "sync": 8, "inference": 2, "train": 4},
      "critic": {"inference": 2, "train": 4}, "ref": {"inference": 2},
      "reward": {"inference": 2}}),
    # The default run's 4 devices on 2 cores: one thread each, as many workers as before.
    (["conf=ppo_tiny"], 2, {role: dict.fromkeys(phases, 1) for role, phases in
                            {"actor": ("generate", "sync", "inference", "train"),
                             "critic": ("inference", "train"), "ref": ("inference",),
                             "reward": ("inference",)}.items()}),
    # A rollout device owns cores too: 8 over 1 + 1 devices.
    (["conf=grpo_tiny", "cluster.num_devices=1", "cluster.group_size=1",
      "rollout.num_devices=1", "ppo.rollout_batch_size=16"], 8,
     {"actor": {"generate": 4, "sync": 4, "inference": 2, "train": 4}, "ref": {"inference": 2},
      "rollout": {"generate": 4, "sync": 4}}),
    # Given: that many in every phase, whatever the cores.
    (["conf=grpo_tiny", "cluster.num_devices=1", "cluster.group_size=1",
      "cluster.cpu_threads=3"], 2,
     {"actor": dict.fromkeys(("generate", "sync", "inference", "train"), 3),
      "ref": {"inference": 3}}),
])
def test_cpu_threads_split_a_devices_cores_among_the_models_that_compute_at_once(
        argv, cores, expected):
    from rlhf_paro.actors.worker import phase_threads
    from rlhf_paro.ppo import algorithms
    from tests.confs import load

    cfg = load(argv)
    roles = [role for role in algorithms.roles(cfg) if cfg.model(role).runs_model]
    threads = {role: phase_threads(cfg, role, cores=cores)
               for role in roles + ["rollout"] * (cfg.rollout.num_devices > 0)}
    assert threads == expected
    if cfg.cluster.cpu_threads is None:  # no phase asks a device for more threads than cores
        per_device = max(1, cores // (cfg.cluster.num_devices + cfg.rollout.num_devices))
        for phase in ("generate", "inference", "train"):
            at_once = [t[phase] for role, t in threads.items() if phase in t
                       and (phase != "generate" or role == "actor")]
            assert sum(at_once) <= per_device or set(at_once) == {1}


def test_cpu_threads_must_be_a_positive_integer():
    from rlhf_paro.config import ConfigError
    from tests.confs import load

    for bad, says in (("0", "must be positive"), ("1.5", "expected an integer")):
        with pytest.raises(ConfigError, match=f"cluster.cpu_threads: {says}"):
            load(["conf=grpo_tiny", f"cluster.cpu_threads={bad}"])


def test_a_models_rendezvous_port_is_held_from_the_moment_rank_0_draws_it():
    """Defect caught: rank 0 finding a free port and releasing it until its process group
    listens on it, so that another process can take it in between (EADDRINUSE at the model's
    setup, seen once in the shared test cluster). The port listens from ``serve_rendezvous`` on,
    and a rank that connects to it meets rank 0's store."""
    import socket

    import torch.distributed as dist

    from rlhf_paro.actors.worker import RENDEZVOUS_TIMEOUT, Worker
    from tests.confs import load

    worker = Worker(load(INLINE), "actor", 0, 2)
    host, port = worker.serve_rendezvous()
    with socket.socket() as other, pytest.raises(OSError):
        other.bind(("", port))
    rank_1 = dist.TCPStore(host, port, is_master=False, timeout=RENDEZVOUS_TIMEOUT)
    rank_1.set("from rank 1", "met")
    assert worker._rendezvous.get("from rank 1") == b"met"
