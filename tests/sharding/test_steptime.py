"""The step-time model on cases computed by hand: the pipeline of one micro-batch, what hides
behind compute, the boundary and update, activation memory and the micro-batch it allows."""

import pytest

from rlhf_paro.comm.simulate import Links
from rlhf_paro.comm.topology import Topology
from rlhf_paro.sharding.layout import UnitSizes
from rlhf_paro.sharding.steptime import (
    Machine, Workload, forward_time, gather_seconds, max_micro_batch, peak_memory, step_time,
    transformer_workload,
)
from rlhf_paro.sharding.strategy import Strategy

US = 1e-6
TOPO = Topology(4, 2)  # 2 groups of 2
# 1 GB/s inside a group, 100 MB/s between groups, no latency: a byte costs 1 ns or 10 ns.
LINKS = Links(intra_bw=1e9, inter_bw=1e8, intra_lat=0.0, inter_lat=0.0)
MACHINE = Machine(LINKS, flops=1e12)  # 1 MFLOP per microsecond
# fp32 root of 1000 elements and two blocks of 2000 (multiples of N: no padding); one sequence
# costs 1 us of compute in the root and 3 us in each block.
UNITS = (UnitSizes(1000, 0), UnitSizes(2000, 0), UnitSizes(2000, 0))
TOY = Workload(UNITS, (1e6, 3e6, 3e6), saved_bytes=0.0, working_bytes=0.0, inference_bytes=0.0,
               precision="fp32", reduce_dtype="fp32")


def test_igg_step_by_hand() -> None:
    # Gathers (P = I: an intra ring of 2, one step of half the 4-byte buffer): root 2000 B,
    # 2 us; a block 4000 B, 4 us.
    # Forward: g0 + c0 + g1 + max(c1, g2) + c2 = 2 + 1 + 4 + max(3, 4) + 3 = 14 us: the
    # prefetch of block 2 runs during block 1 and outlasts it by 1 us.
    # Backward reduce-scatter (G = G: the world ring in rank order, 3 steps of a quarter of
    # the buffer, each waiting for the inter hop at 10 ns/B): root 3 x 1000 B = 30 us, a block
    # 60 us. Backward compute is twice the forward (all trainable): 2, 6, 6 us.
    # Backward: g0 + c0 + r0 + g2 + [max(c2, g1) + r2] + [c1 + r1]
    #         = 2 + 2 + 30 + 4 + [max(6, 4) + 60] + [6 + 60] = 170 us.
    # Boundary: only the norm (4 bytes, world all-reduce: 6 steps of 1 B at 10 ns) = 0.06 us.
    # Update (OS = G to P = I: an inter all-gather of the I-shard, one step of half of it):
    # the root's I-shard is 1000 x 4 / 2 = 2000 B, the step sends 1000 B at 10 ns: 10 us; a
    # block 20 us; 50 us in all.
    t = step_time(Strategy.parse("IGG"), TOY, TOPO, MACHINE, micro_batch=1, num_micro=2)
    assert t.total == pytest.approx((2 * (14 + 170) + 0.06 + 50) * US, rel=1e-12)
    assert t.compute == pytest.approx(2 * (7 + 14) * US, rel=1e-12)
    assert t.by_phase["update"] == pytest.approx(50 * US, rel=1e-12)
    assert t.by_phase["boundary"] == pytest.approx(0.06 * US, rel=1e-12)
    # Hidden: per micro-batch, forward hides 3 of block 2's 4 us and backward all 4 of block
    # 1's: 7 us, twice.
    assert t.hidden == pytest.approx(14 * US, rel=1e-9)
    # Collectives: per micro-batch 3 units x (gather, gather, reduce-scatter); per step 3
    # updates and the norm.
    assert t.messages == 2 * 9 + 3 + 1


def test_ring_schedules_run_inline_and_hide_nothing() -> None:
    # GGG gathers on the world. Native: the prefetch overlaps; HO-Ring runs inline (the
    # engine's ring executor is synchronous). A world all-gather of a block (8000 B) on
    # HO-Ring over 2 x 2: step 1 the inter ring (2000 B at 10 ns = 20 us) beside the intra
    # ring, step 2 one intra step of 2000 B (2 us): 22 us; the root 11 us.
    t = forward_time(Strategy.parse("G", frozen=True), TOY, TOPO, MACHINE, 1, "horing")
    assert t.total == pytest.approx((11 + 1 + 22 + 3 + 22 + 3) * US, rel=1e-12)
    assert t.hidden == 0.0
    # Native: the world ring, 3 steps of 2000 B bound by the inter hop, 60 us a block and
    # 30 us the root; block 2's gather starts with block 1's compute: 30 + 1 + 60 + 60 + 3.
    t = forward_time(Strategy.parse("G", frozen=True), TOY, TOPO, MACHINE, 1, "native")
    assert t.total == pytest.approx((30 + 1 + 60 + max(3, 60) + 3) * US, rel=1e-12)
    assert gather_seconds(Strategy.parse("G", frozen=True), TOY, TOPO, MACHINE) == \
        pytest.approx(150 * US, rel=1e-12)


def test_ring_links_time_our_ring_schedules_only() -> None:
    # Ring links twice as fast as the native ones: HO-Ring's world gather of a block (8000 B)
    # becomes 2000 B at 5 ns on the NIC beside 2000 B at 0.5 ns inside the group, then one
    # intra step of 2000 B: 10 + 1 = 11 us (22 us on LINKS); the root 5.5 us.
    fast = Machine(LINKS, flops=1e12, ring_links=Links(2e9, 2e8, 0.0, 0.0))
    frozen = Strategy.parse("G", frozen=True)
    t = forward_time(frozen, TOY, TOPO, fast, 1, "horing")
    assert t.total == pytest.approx((5.5 + 1 + 11 + 3 + 11 + 3) * US, rel=1e-12)
    # Native collectives keep the native links (the values of the test above).
    t = forward_time(frozen, TOY, TOPO, fast, 1, "native")
    assert t.total == pytest.approx((30 + 1 + 60 + max(3, 60) + 3) * US, rel=1e-12)


def test_overlapped_reductions_hide_behind_the_next_units_backward() -> None:
    # NGG, one micro-batch of 10 sequences: backward compute 20 us (root), 60 us a block;
    # each unit's gradient reduce-scattered on the world ring (3 steps of a quarter at
    # 10 ns/B): 30 us the root, 60 us a block. Backward order: root, block 2, block 1.
    # Synchronous: 20 + 30 + (60 + 60) + (60 + 60) = 290 us.
    # Overlapped: the root's reduction runs during block 2's compute, block 2's during
    # block 1's, and block 1's is exposed: 20 + max(60, 30) + max(60, 60) + 60 = 200 us.
    # Around it: forward 70 us, the norm 0.06 us, the update all-gather 30 + 60 + 60 us.
    ngg = Strategy.parse("NGG")
    sync = step_time(ngg, TOY, TOPO, MACHINE, 10, 1)
    over = step_time(ngg, TOY, TOPO, MACHINE, 10, 1, overlap_reduce=True)
    assert sync.total == pytest.approx((70 + 290 + 0.06 + 150) * US, rel=1e-12)
    assert over.total == pytest.approx((70 + 200 + 0.06 + 150) * US, rel=1e-12)
    assert over.hidden - sync.hidden == pytest.approx(90 * US, rel=1e-9)
    # On HO-Ring the world reduce-scatter is a ring schedule of ours: inline, nothing hides.
    assert step_time(ngg, TOY, TOPO, MACHINE, 10, 1, "horing", overlap_reduce=True).total \
        == step_time(ngg, TOY, TOPO, MACHINE, 10, 1, "horing").total


def test_reduces_per_owner_cost_a_chain_per_partition() -> None:
    # NGG with the gradient reduced as one reduce per owner of a flat partition of the whole
    # model over the N = 4 ranks. Shares: root 1000 / 5000 = 0.2, a block 0.4, so the root
    # overlaps 1 + 4 x 0.2 = 1.8 partitions on average and a block 2.6: 7 reduces a
    # micro-batch (N + units). Each reduce is a chain of 3 world steps at 10 us, plus its
    # bytes once at 1 TB/s: the root 1.8 x 30 us + 4000 B, a block 2.6 x 30 us + 8000 B.
    slow = Machine(Links(1e12, 1e12, intra_lat=1 * US, inter_lat=10 * US), flops=1e30)
    ngg = Strategy.parse("NGG")
    owner = step_time(ngg, TOY, TOPO, slow, 1, 2, reduce_per_owner=True)
    ring = step_time(ngg, TOY, TOPO, slow, 1, 2)
    per_micro = (1.8 + 2.6 + 2.6) * 30 * US + (4000 + 8000 + 8000) / 1e12
    assert owner.by_phase["backward"] == pytest.approx(2 * per_micro, rel=1e-12)
    # The ring reduce-scatter: 3 steps of 10 us plus a quarter of the buffer per step, per unit.
    ring_micro = 3 * 3 * 10 * US + 3 * (1000 + 2000 + 2000) / 1e12
    assert ring.by_phase["backward"] == pytest.approx(2 * ring_micro, rel=1e-12)
    assert owner.total - ring.total == pytest.approx(2 * (per_micro - ring_micro), rel=1e-9)
    # Messages: 7 reduces twice, the update all-gather of 3 units and the norm.
    assert owner.messages == 2 * 7 + 3 + 1 and ring.messages == 2 * 3 + 3 + 1


def test_replicated_parameters_and_gradients_only_communicate_at_the_boundary() -> None:
    # NNN: compute only, then the gradient all-reduce over the world (native ring: 6 steps of
    # a quarter of the buffer at 10 ns/B): root 6 x 1000 B = 60 us, blocks 120 us each.
    t = step_time(Strategy.parse("NNN"), TOY, TOPO, MACHINE, micro_batch=2, num_micro=3)
    compute = 3 * 2 * (7 + 14) * US  # s x b x (forward + backward) per sequence
    assert t.compute == pytest.approx(compute, rel=1e-12)
    assert t.total == pytest.approx(compute + 300 * US, rel=1e-12)
    assert t.by_phase["forward"] == t.by_phase["backward"] == t.hidden == 0.0


def test_latency_makes_many_small_collectives_expensive() -> None:
    # Principle 3: with LoRA-sized trainable buffers (4 elements per unit) the bytes are
    # nothing and every collective costs its steps' latencies. NGG reduce-scatters each
    # unit's gradient over the world every micro-batch: 3 ring steps x 10 us, 3 units, 4
    # micro-batches = 360 us; NNG waits for the boundary: the same 3 units once = 90 us.
    slow = Machine(Links(1e12, 1e12, intra_lat=1 * US, inter_lat=10 * US), flops=1e30)
    lora = Workload(tuple(UnitSizes(4, 4000) for _ in range(3)), (0.0,) * 3, 0.0, 0.0, 0.0,
                    precision="fp32", reduce_dtype="fp32")
    ngg = step_time(Strategy.parse("NGG"), lora, TOPO, slow, 1, 4)
    nng = step_time(Strategy.parse("NNG"), lora, TOPO, slow, 1, 4)
    # Both: norm (6 steps) and update all-gather (3 steps) of each unit at 10 us a step.
    shared = (6 + 3 * 3) * 10 * US
    assert ngg.total == pytest.approx(360 * US + shared, rel=1e-6)
    assert nng.total == pytest.approx(90 * US + shared, rel=1e-6)


def test_transformer_workload_by_hand() -> None:
    # h = 8, F = 16, V = 32, L = 4, two blocks of 100 parameters, bf16 (e = 2).
    units = [UnitSizes(300, 0), UnitSizes(100, 0), UnitSizes(100, 0)]
    w = transformer_workload(units, hidden=8, ffn=16, vocab=32, seq_len=4)
    assert w.flops == (2 * 4 * 8 * 32, 2 * 4 * 100 + 2 * 16 * 8, 2 * 4 * 100 + 2 * 16 * 8)
    block = (8 * 8 + 4 * 16) * 2  # 256 bytes per token
    assert w.saved_bytes == 4 * (2 * block + 2 * 8 * 2)
    assert w.working_bytes == 4 * 32 * (2 + 8)
    assert w.inference_bytes == 4 * ((16 + 32) * 2 + 32 * 6)
    ckpt = transformer_workload(units, hidden=8, ffn=16, vocab=32, seq_len=4,
                                checkpointing=True)
    assert ckpt.saved_bytes == 4 * (2 * 8 * 2 + 2 * 8 * 2)
    assert ckpt.working_bytes == 4 * (32 * 10 + block)


def test_peak_memory_by_hand() -> None:
    # GGG, fp32 gradients reduced in fp32, bf16 parameters, N = 4: states per unit
    # (2 + 4 + 12) / 4 bytes per element of 400, 400, 400 elements = 5400 B.
    units = (UnitSizes(400, 0), UnitSizes(400, 0), UnitSizes(400, 0))
    w = Workload(units, (0.0,) * 3, saved_bytes=100.0, working_bytes=10.0,
                 inference_bytes=1.0, precision="bf16", reduce_dtype="fp32")
    mem = peak_memory(Strategy.parse("GGG"), w, TOPO, micro_batch=2)
    assert mem.states == 1200 * 18 // 4
    # Training: 2 x 110 activations + the root and two blocks gathered (3 x 400 x 2 B) + one
    # unit's gradient in bf16 and again in fp32 (400 x 6 B) = 220 + 2400 + 2400; the boundary
    # needs 1200 x 4 / 4 + 400 x 4 / 4 = 1600, less.
    assert mem.train == mem.states + 5020
    assert mem.inference == mem.states + 2400 + 2
    assert mem.gathered == mem.states + 1200 * 2 - 1200 * 2 // 4  # every unit, minus the shard
    # NNN holds the full buffers, gathers nothing, and at the boundary keeps the fp32 OS-level
    # gradient of every unit (4800 B) beside the states.
    nnn = peak_memory(Strategy.parse("NNN"), w, TOPO, micro_batch=2)
    assert nnn.train == nnn.states + max(220 + 2400, 4800 + 1600)


def test_freed_memory_buys_a_larger_micro_batch() -> None:
    units = (UnitSizes(400, 0), UnitSizes(400, 0), UnitSizes(400, 0))
    w = Workload(units, (1e6,) * 3, saved_bytes=1000.0, working_bytes=0.0,
                 inference_bytes=0.0, precision="bf16", reduce_dtype="fp32")
    budget = peak_memory(Strategy.parse("NNG"), w, TOPO, 2).train
    # NNG fits b = 2 exactly; GGG holds 400 x 3 x (2 + 4) x 3/4 = 5400 B less in P and G and
    # gathers at most 2400 B, so b grows by 3 (3000 B) and no more.
    assert max_micro_batch(Strategy.parse("NNG"), w, TOPO, budget, range(1, 9)) == 2
    assert max_micro_batch(Strategy.parse("GGG"), w, TOPO, budget, range(1, 9)) == 5
    assert max_micro_batch(Strategy.parse("NNN"), w, TOPO, budget, range(1, 9)) is None
