"""The weight transfer to a rollout replica on a CUDA device (docs/design.md, "Asynchronous
rollouts"): an actor process sends its weights, a replica process on the same GPU takes them
into its own copy (gloo: NCCL takes one device a process), and the replica's greedy rollout is
the actor's own; the transfer's time is printed (pytest -s)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CONFIG = {"model_type": "llama", "hidden_size": 512, "intermediate_size": 1024,
          "num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 8,
          "max_position_embeddings": 256}
VOCAB = 64


def _prompts():
    from rlhf_paro.rollout import PromptBatch

    gen = torch.Generator().manual_seed(0)
    return PromptBatch.left_padded([[1, *torch.randint(3, VOCAB, (int(n),), generator=gen)
                                     .tolist()] for n in torch.randint(4, 17, (32,),
                                                                       generator=gen)], 0)


def _side(rank: int, port: int, results) -> None:
    from rlhf_paro import models
    from rlhf_paro.comm.transfer import TransferGroup
    from rlhf_paro.config import ModelConfig
    from rlhf_paro.rollout import Sampling
    from rlhf_paro.rollout.hf import HFReplica, HFRollout, LocalWeights
    from rlhf_paro.sharding import Topology, shard

    cuda = torch.device("cuda")
    # The replica starts from other weights: only the transfer makes them the actor's.
    module = models.build_model("actor", ModelConfig(config=CONFIG), VOCAB, seed=rank)
    group = TransferGroup("127.0.0.1", port, "transfer0/", rank, 2, cuda, backend="gloo",
                          same_node=[True])
    sampling = Sampling(max_new_tokens=32, greedy=True)
    if rank == 0:
        engine = shard(module, "NNN", Topology(1, 1), device="cuda")
        named = list(models.hf_weights(engine.module, engine.unit_parameters(), 1.0))
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _, tensor in named:
            group.broadcast(tensor.contiguous())
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        out = HFRollout(engine, 0, 2, cuda).generate(_prompts(), sampling)
        results.put((0, out.sequences, seconds, group.meter.totals()["intra_bytes"],
                     [(n, tuple(t.shape), str(t.dtype)) for n, t in named]))
    else:
        # The order the actor sends in: the same walk of its units (what the actor's weight
        # manifest gives a RolloutWorker), here from a sharded copy of the same architecture.
        twin = shard(models.build_model("actor", ModelConfig(config=CONFIG), VOCAB, seed=9),
                     "NNN", Topology(1, 1))
        order = [n for n, _ in models.hf_weights(twin.module, twin.unit_parameters(), 1.0)]
        replica = HFReplica(LocalWeights(module.to(cuda)), 0, 2, cuda)
        before = replica.generate(_prompts(), sampling).sequences

        def stream():
            for name in order:
                tensor = torch.empty_like(replica.engine.params[name])
                group.broadcast(tensor)
                yield name, tensor

        replica.sync(stream())
        out = replica.generate(_prompts(), sampling)
        results.put((1, out.sequences, before, None, None))


def test_a_replica_on_a_gpu_takes_the_actors_weights_and_generates_its_rollout():
    from rlhf_paro.comm.transfer import serve_store

    store, port = serve_store("127.0.0.1")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_side, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict((r[0], r[1:]) for r in (results.get(timeout=600) for _ in range(2)))
    for p in procs:
        p.join(60)
    actor_out, seconds, sent, manifest = got[0]
    replica_out, before, _, _ = got[1]
    # Every weight once (a tied weight once), each landing where its name says.
    size = sum(torch.Size(shape).numel() * 4 for _, shape, _ in manifest)
    assert sent == size
    assert torch.equal(replica_out, actor_out)
    assert not torch.equal(before, actor_out)  # other weights gave another rollout before
    print(f"\nweights of {size / 2**20:.1f} MiB to a replica on {torch.cuda.get_device_name()} "
          f"over gloo in {seconds * 1e3:.0f} ms ({size / seconds / 1e9:.2f} GB/s)")
    del store
