"""The step-time model on cases computed by hand: one optimizer step on a compute stream and a
communication lane, what hides behind compute (prefetched gathers, reductions in flight, the
boundary started in the last backward), buckets, the boundary and update, activation memory and
the micro-batch it allows."""

from dataclasses import replace

import pytest

from rlhf_paro.comm.simulate import Links
from rlhf_paro.comm.topology import Topology
from rlhf_paro.sharding.layout import UnitSizes
from rlhf_paro.sharding.steptime import (
    ENGINE, Machine, Workload, forward_time, gather_seconds, max_micro_batch, peak_memory,
    step_time, transformer_workload,
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
# The engine with every unit's gradient reduced alone (the toy units are far below a bucket).
ALONE = replace(ENGINE, bucket_numel=1)


def test_engine_rules_are_the_engines() -> None:
    # One source: the model's engine reads the engine's cap and the schedule's bucket rule.
    from rlhf_paro.sharding.engine import REDUCTIONS_IN_FLIGHT
    from rlhf_paro.sharding.schedule import BUCKET_NUMEL

    assert ENGINE.reductions_in_flight == REDUCTIONS_IN_FLIGHT
    assert ENGINE.bucket_numel == BUCKET_NUMEL
    assert ENGINE.boundary_in_backward and ENGINE.async_rings and not ENGINE.reduce_per_owner


def test_igg_step_by_hand() -> None:
    # Gathers (P = I: an intra ring of 2, one step of half the 4-byte buffer): root 2 us, a
    # block 4 us. Reduce-scatters (G = G: the world ring, 3 steps of a quarter of the buffer
    # at 10 ns/B): root 30 us, a block 60 us. Norm (world all-reduce of 4 B, 6 steps of 1 B):
    # 0.06 us. Update (OS = G to P = I: an inter all-gather, one step of half the I-shard):
    # root 10 us, a block 20 us. Compute: forward 1, 3, 3 us; backward twice that.
    # Forward (time t, lane free at L): root gathered, t = 2; block 1 gathered, t = 6; block
    # 2 prefetched, L = 10; block 1 computes, t = 9; waits for block 2, t = 10; computes,
    # t = 13; the head, t = 14.
    # Backward: root gathered again, t = 16; head 2 us, t = 18; block 2 gathered, t = 22;
    # block 1 prefetched, L = 26; block 2 computes, t = 28, its reduce-scatter on the lane
    # 28..88; block 1 computes, t = 34, its reduce-scatter 88..148; the root's at the end
    # 148..178, the third in flight: the oldest is waited for, t = 88.
    # step(): the other two, t = 178; the norm, 178.06; the update 10 + 20 + 20: 228.06 us.
    t = step_time(Strategy.parse("IGG"), TOY, TOPO, MACHINE, 1, 1, system=ALONE)
    assert t.total == pytest.approx(228.06 * US, rel=1e-12)
    assert t.in_step == pytest.approx((228.06 - 88) * US, rel=1e-12)  # after the backward
    assert t.compute == pytest.approx(21 * US, rel=1e-12)
    assert t.by_phase == pytest.approx({"forward": 10 * US, "backward": 160 * US,
                                        "boundary": 0.06 * US, "update": 50 * US})
    assert t.hidden == pytest.approx((21 + 220.06 - 228.06) * US, rel=1e-9)
    # Collectives: 3 units x (gather, gather, reduce-scatter); 3 updates and the norm.
    assert t.messages == 9 + 3 + 1


def test_reductions_in_flight_hide_behind_the_rest_of_the_backward() -> None:
    # NGG, one micro-batch of 10 sequences: compute forward 10, 30, 30 us, backward 20, 60,
    # 60 us; reduce-scatters 30 us (root), 60 us (a block); update all-gather 30 + 60 + 60.
    # In flight: forward t = 70; head, 90; block 2, 150, reduce 150..210; block 1, 210,
    # reduce 210..270; root's 270..300 (the third: wait for the oldest, t = 210); step()
    # waits for the rest, t = 300; norm 0.06; update 150: 450.06 us.
    # Inline (a system that waits for each): 90 + 60 + 60 + 60 + 60 + 30 = 360; 510.06 us.
    ngg = Strategy.parse("NGG")
    flight = step_time(ngg, TOY, TOPO, MACHINE, 10, 1, system=ALONE)
    inline = step_time(ngg, TOY, TOPO, MACHINE, 10, 1,
                       system=replace(ALONE, reductions_in_flight=0))
    assert flight.total == pytest.approx(450.06 * US, rel=1e-12)
    assert inline.total == pytest.approx(510.06 * US, rel=1e-12)
    assert flight.hidden - inline.hidden == pytest.approx(60 * US, rel=1e-9)


def test_reductions_in_flight_run_into_the_next_forward() -> None:
    # NGG, two micro-batches of one sequence, all three units in one bucket (the engine's
    # rule: 5000 elements, below BUCKET_NUMEL): one world reduce-scatter of 20000 B, 3 steps
    # of 5000 B at 10 ns = 150 us, posted at the end of each backward. Micro-batch 1: 7 + 14
    # us of compute, t = 21, its reduction 21..171; micro-batch 2 computes meanwhile (no
    # gathers: P = N), t = 42, its reduction 171..321; step() waits, t = 321; norm 0.06;
    # update 150: 471.06 us.
    t = step_time(Strategy.parse("NGG"), TOY, TOPO, MACHINE, 1, 2)
    assert t.total == pytest.approx(471.06 * US, rel=1e-12)
    assert t.by_phase["backward"] == pytest.approx(300 * US, rel=1e-12)
    assert t.messages == 2 * 1 + 3 + 1  # one bucket a micro-batch; 3 updates and the norm


def test_the_boundary_starts_in_the_last_backward() -> None:
    # NNG, one micro-batch of 10 sequences: gradients stay at N until the boundary, whose
    # first collective is each unit's world reduce-scatter N -> G (60 us a block, 30 the
    # root). Started at each unit's post-backward: blocks 150..210 and 210..270 beside the
    # backward, the root's 270..300 at its end; step() waits, t = 300; norm 0.06; update
    # G -> N on the world, 150 us: 450.06. Started in step() instead: 210 + 150 + 0.06 + 150.
    nng = Strategy.parse("NNG")
    early = step_time(nng, TOY, TOPO, MACHINE, 10, 1)
    late = step_time(nng, TOY, TOPO, MACHINE, 10, 1,
                     system=replace(ENGINE, boundary_in_backward=False))
    assert early.total == pytest.approx(450.06 * US, rel=1e-12)
    assert early.in_step == pytest.approx((450.06 - 210) * US, rel=1e-12)
    assert late.total == pytest.approx(510.06 * US, rel=1e-12)


def test_ring_schedules_are_prefetched_like_native_ones() -> None:
    # G frozen on HO-Ring over 2 x 2: a world all-gather of a block (8000 B): step 1 the inter
    # ring (2000 B at 10 ns = 20 us) beside the intra ring, step 2 one intra step of 2000 B
    # (2 us): 22 us; the root 11 us. The engine posts them on the group's lane: root 11,
    # block 1 33, block 2 prefetched 33..55 behind block 1's 3 us, then 3 us and the head:
    # 59 us. A system that runs rings inline: 11 + 22 + 3 + 22 + 3 + 1 = 62 us.
    frozen = Strategy.parse("G", frozen=True)
    t = forward_time(frozen, TOY, TOPO, MACHINE, 1, "horing")
    assert t.total == pytest.approx(59 * US, rel=1e-12)
    assert t.hidden == pytest.approx(3 * US, rel=1e-9)
    inline = forward_time(frozen, TOY, TOPO, MACHINE, 1, "horing",
                          system=replace(ENGINE, async_rings=False))
    assert inline.total == pytest.approx(62 * US, rel=1e-12) and inline.hidden == 0.0
    # Native: the world ring, 3 steps of 2000 B bound by the inter hop, 60 us a block and
    # 30 us the root: 30 + 60 + 3 (prefetch 60 us) + 57 + 3 + 1.
    t = forward_time(frozen, TOY, TOPO, MACHINE, 1, "native")
    assert t.total == pytest.approx((30 + 60 + 60 + 3 + 1) * US, rel=1e-12)
    assert gather_seconds(frozen, TOY, TOPO, MACHINE) == pytest.approx(150 * US, rel=1e-12)


def test_ring_links_time_our_ring_schedules_only() -> None:
    # Ring links twice as fast as the native ones: HO-Ring's world gather of a block (8000 B)
    # becomes 2000 B at 5 ns on the NIC beside 2000 B at 0.5 ns inside the group, then one
    # intra step of 2000 B: 10 + 1 = 11 us (22 us on LINKS); the root 5.5 us. Forward:
    # 5.5 + 11, block 2 prefetched behind block 1 (11 us against 3), 3 us, the head 1 us.
    fast = Machine(LINKS, flops=1e12, ring_links=Links(2e9, 2e8, 0.0, 0.0))
    frozen = Strategy.parse("G", frozen=True)
    t = forward_time(frozen, TOY, TOPO, fast, 1, "horing")
    assert t.total == pytest.approx((5.5 + 11 + 11 + 3 + 1) * US, rel=1e-12)
    # Native collectives keep the native links (the values of the test above).
    t = forward_time(frozen, TOY, TOPO, fast, 1, "native")
    assert t.total == pytest.approx((30 + 60 + 60 + 3 + 1) * US, rel=1e-12)


def test_native_ports_time_the_native_collectives_they_were_fitted_to() -> None:
    # Native world gathers measured twice as fast as the ports compose them: the forward's
    # gathers take half (the values of test_ring_links...: 30 + 60 + 60 + 3 + 1 us with
    # LINKS, the gathers 30, 60 and 60 of them). Other algorithms keep LINKS.
    half = Links(2 * LINKS.intra_bw, 2 * LINKS.inter_bw, 0.0, 0.0)
    fitted = Machine(LINKS, flops=1e12, native={("all_gather", "world"): half})
    frozen = Strategy.parse("G", frozen=True)
    plain = forward_time(frozen, TOY, TOPO, MACHINE, 1, "native")
    fast = forward_time(frozen, TOY, TOPO, fitted, 1, "native")
    assert fast.by_phase["forward"] == pytest.approx(plain.by_phase["forward"] / 2, rel=1e-12)
    assert forward_time(frozen, TOY, TOPO, fitted, 1, "horing").total == pytest.approx(
        forward_time(frozen, TOY, TOPO, MACHINE, 1, "horing").total, rel=1e-12)


def test_reduces_per_owner_cost_a_chain_per_partition() -> None:
    # NGG with the gradient reduced as one reduce per owner of a flat partition of the whole
    # model over the N = 4 ranks. Shares: root 1000 / 5000 = 0.2, a block 0.4, so the root
    # overlaps 1 + 4 x 0.2 = 1.8 partitions on average and a block 2.6: 7 reduces a
    # micro-batch (N + units). Each reduce is a chain of 3 world steps at 10 us, plus its
    # bytes once at 1 TB/s: the root 1.8 x 30 us + 4000 B, a block 2.6 x 30 us + 8000 B.
    # No compute: everything is on the lane, one collective after another.
    slow = Machine(Links(1e12, 1e12, intra_lat=1 * US, inter_lat=10 * US), flops=1e30)
    ngg = Strategy.parse("NGG")
    owner = step_time(ngg, TOY, TOPO, slow, 1, 2, system=replace(ALONE, reduce_per_owner=True))
    ring = step_time(ngg, TOY, TOPO, slow, 1, 2, system=ALONE)
    per_micro = (1.8 + 2.6 + 2.6) * 30 * US + (4000 + 8000 + 8000) / 1e12
    assert owner.by_phase["backward"] == pytest.approx(2 * per_micro, rel=1e-12)
    # The ring reduce-scatter: 3 steps of 10 us plus a quarter of the buffer per step, per unit.
    ring_micro = 3 * 3 * 10 * US + 3 * (1000 + 2000 + 2000) / 1e12
    assert ring.by_phase["backward"] == pytest.approx(2 * ring_micro, rel=1e-12)
    assert owner.total - ring.total == pytest.approx(2 * (per_micro - ring_micro), rel=1e-9)
    # Messages: 7 reduces twice, the update all-gather of 3 units and the norm.
    assert owner.messages == 2 * 7 + 3 + 1 and ring.messages == 2 * 3 + 3 + 1


def test_replicated_parameters_all_reduce_from_the_last_backward() -> None:
    # NNN, 3 micro-batches of 2 sequences: 14 + 28 us of compute each. The boundary's one
    # collective, the world all-reduce (native ring: 6 steps of a quarter of the buffer at
    # 10 ns/B; root 60 us, blocks 120 us), starts at each unit's post-backward in the last
    # micro-batch: t = 84 + 14 + 4 (head) + 12 (block 2), then block 2's all-reduce 114..234,
    # block 1's 234..354 (its backward ends at 126), the root's 354..414.
    t = step_time(Strategy.parse("NNN"), TOY, TOPO, MACHINE, micro_batch=2, num_micro=3)
    assert t.compute == pytest.approx(3 * 2 * (7 + 14) * US, rel=1e-12)
    assert t.total == pytest.approx(414 * US, rel=1e-12)
    assert t.by_phase["boundary"] == pytest.approx(300 * US, rel=1e-12)
    assert t.by_phase["forward"] == t.by_phase["backward"] == 0.0
    assert t.hidden == pytest.approx(12 * US, rel=1e-9)


def test_buckets_make_many_small_reductions_few() -> None:
    # Principle 3: with LoRA-sized trainable buffers (4 elements per unit) the bytes are
    # nothing and every collective costs its steps' latencies (10 us a world step). NGG
    # reduce-scatters the gradient over the world every micro-batch: the three units in one
    # bucket, 3 ring steps x 4 micro-batches = 120 us (360 us with each unit alone); NNG
    # reduces once, at the boundary, unit by unit: 3 units x 30 us = 90 us.
    slow = Machine(Links(1e12, 1e12, intra_lat=1 * US, inter_lat=10 * US), flops=1e30)
    lora = Workload(tuple(UnitSizes(4, 4000) for _ in range(3)), (0.0,) * 3, 0.0, 0.0, 0.0,
                    precision="fp32", reduce_dtype="fp32")
    ngg = step_time(Strategy.parse("NGG"), lora, TOPO, slow, 1, 4)
    alone = step_time(Strategy.parse("NGG"), lora, TOPO, slow, 1, 4, system=ALONE)
    nng = step_time(Strategy.parse("NNG"), lora, TOPO, slow, 1, 4)
    # All three: norm (6 steps) and update all-gather (3 steps) of each unit at 10 us a step.
    shared = (6 + 3 * 3) * 10 * US
    assert ngg.total == pytest.approx(120 * US + shared, rel=1e-6)
    assert alone.total == pytest.approx(360 * US + shared, rel=1e-6)
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
    assert mem.unit == mem.states + 400 * 2  # one unit at a time, to sync a rollout engine
    # NNN holds the full buffers, gathers nothing, and at the boundary keeps the fp32 OS-level
    # gradient of every unit (4800 B) beside the states.
    nnn = peak_memory(Strategy.parse("NNN"), w, TOPO, micro_batch=2)
    assert nnn.train == nnn.states + max(220 + 2400, 4800 + 1600)
    assert nnn.unit == nnn.gathered == nnn.states  # the module's parameters are the buffers


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
