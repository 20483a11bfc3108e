"""The step-time model against a trace of the real engine on 4 gloo ranks (2 groups of 2 on
loopback): a small Llama, three strategies far apart in how much they communicate, each step
traced as its passes and its ``step()``. The model's constants (FLOP/s, each port's latency and
bandwidth) are measured in the same run, on the same ranks, by probes that run in the same
rotated rounds as the steps (``scripts/check_steptime.py``'s own functions), so that the load of
the machine falls on the constants as it falls on the steps.

Tolerances. The constants and the steps take the fastest of 9 rounds (on a shared machine the
least disturbed one; a median still moves with the load). Observed in five runs on a 2-core
machine shared with other work, load average 3 to 25: predicted / measured steps from -43% to
+4%, ratios to GGG within 29% of the measured ones, and IGG measured within 4% of GGG where the
model puts it 27-29% below. On loopback the intra and inter "ports" are the same memory copies,
and on 2 cores the ranks' communication takes CPU from their compute, which the model lets
overlap freely: it underrates every step, the cheap ones most. Once, in CI on a quiet machine,
NNN came out at -58% (36 ms predicted against 87: a FLOP/s probe whose fastest round ran well
above the others, and a boundary all-reduce that gloo runs 2 to 3 times slower than its port),
its ratio to GGG 46% from the measured one; four runs after it gave -36% to -46% and ratios
within 24%. So the test holds: the order of every pair the model puts more than ORDER_GAP apart
(NNN below IGG and GGG; IGG against GGG is not held), each strategy's ratio to GGG within
RATIO_TOLERANCE of the measured one, each step within a factor of ABSOLUTE_FACTOR of its
prediction, and the phases: NNN communicates only in ``step()`` (the boundary all-reduce) and
GGG mostly in its passes (world gathers and reduce-scatters every micro-batch), so ``step()``
takes a larger share of NNN's step than of GGG's, predicted and measured alike.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.dist_utils import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.slow]

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_steptime.py"
STRATEGIES = ("NNN", "IGG", "GGG")
HIDDEN, LAYERS, VOCAB, SEQ, BATCH, MICRO, ROUNDS = 256, 2, 256, 8, 1, 4, 9
RATIO_TOLERANCE = 0.6
ORDER_GAP = 1.5
ABSOLUTE_FACTOR = 3.0


def _check_steptime():
    spec = importlib.util.spec_from_file_location("check_steptime", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rank(rank: int, world: int):
    import torch

    from rlhf_paro.sharding import Strategy, Topology, shard
    from rlhf_paro.sharding.layout import unit_sizes
    from rlhf_paro.sharding.steptime import step_time, transformer_workload

    check = _check_steptime()
    topo = Topology.from_process_group(group_size=2)
    ids = torch.randint(0, VOCAB, (MICRO, BATCH, SEQ),
                        generator=torch.Generator().manual_seed(rank))
    reference = check.llama(HIDDEN, LAYERS, VOCAB, SEQ)
    w = transformer_workload(unit_sizes(reference), hidden=HIDDEN, ffn=4 * HIDDEN, vocab=VOCAB,
                             seq_len=SEQ, precision="fp32", reduce_dtype="fp32")
    engines = {name: shard(check.llama(HIDDEN, LAYERS, VOCAB, SEQ), name, topo,
                           optim=dict(lr=1e-4), max_grad_norm=1.0, grad_accum_steps=MICRO)
               for name in STRATEGIES}
    measured, probed = check.trace(engines, ids, ROUNDS,
                                   check.probes(reference, ids[0], topo, large=1 << 20))
    # The fastest round of each: on a shared machine the least disturbed one, for the
    # constants and the steps alike (a median still moves with the load).
    machine = check.machine({k: min(t) for k, t in probed.items()}, w, BATCH, topo)
    predicted = {name: step_time(Strategy.parse(name), w, Topology(world, 2), machine, BATCH,
                                 MICRO) for name in STRATEGIES}
    return predicted, measured


def test_predicted_steps_hold_against_a_trace_of_the_engine() -> None:
    predicted, measured = run_distributed(_rank, 4, timeout=300)[0]
    lines, error, _ = _check_steptime().report(predicted, measured, "GGG", min)
    table = "\n".join(lines)
    step = {k: min(t for t, _ in v) for k, v in measured.items()}
    in_step = {k: min(s for _, s in v) for k, v in measured.items()}
    for a in STRATEGIES:
        for b in STRATEGIES:
            if predicted[b].total > ORDER_GAP * predicted[a].total:
                assert step[a] < step[b], f"{a} against {b}\n{table}"
    for name in STRATEGIES:
        ratio_p = predicted[name].total / predicted["GGG"].total
        ratio_m = step[name] / step["GGG"]
        assert abs(ratio_p / ratio_m - 1) <= RATIO_TOLERANCE, f"{name}\n{table}"
        assert 1 / ABSOLUTE_FACTOR <= 1 + error[name] <= ABSOLUTE_FACTOR, f"{name}\n{table}"
    share_p = {k: predicted[k].in_step / predicted[k].total for k in ("NNN", "GGG")}
    share_m = {k: in_step[k] / step[k] for k in ("NNN", "GGG")}
    assert share_p["NNN"] > share_p["GGG"] and share_m["NNN"] > share_m["GGG"], table
