"""The closed forms of cost.py against the paper's Table 2, Table 3 and equation (1)."""

import pytest

from rlhf_paro.sharding.cost import UnitSizes, memory, setup_memory, traffic
from rlhf_paro.sharding.strategy import Strategy

N, M = 64, 8  # the paper's Figure 5 cluster
G = N // M
PSI = 7 * 2**30  # divisible by N, so no padding
UNITS = [UnitSizes(PSI, 0)]


@pytest.mark.parametrize("name,p,g,os", [
    # Table 2 with mixed precision: 2 bytes per P element, K = 12; G is 4 bytes per element
    # where Table 2 has 2, because gradients accumulate in fp32 (cost.py's docstring).
    ("NNG", 2 * PSI, 4 * PSI, 12 * PSI // N),          # ZeRO-1
    ("NGG", 2 * PSI, 4 * PSI // N, 12 * PSI // N),     # ZeRO-2
    ("GGG", 2 * PSI // N, 4 * PSI // N, 12 * PSI // N),  # ZeRO-3
    ("III", 2 * PSI // M, 4 * PSI // M, 12 * PSI // M),  # MiCS
    ("IGG", 2 * PSI // M, 4 * PSI // N, 12 * PSI // N),
    ("IIG", 2 * PSI // M, 4 * PSI // M, 12 * PSI // N),
    ("NIG", 2 * PSI, 4 * PSI // M, 12 * PSI // N),
])
def test_memory_matches_table_2(name: str, p: int, g: int, os: int) -> None:
    assert memory(Strategy.parse(name), UNITS, N, M, "bf16") == {"params": p, "grads": g,
                                                                "optim": os}


def test_frozen_parameters_have_no_gradient_or_optimizer_state() -> None:
    mem = memory(Strategy.parse("GGG"), [UnitSizes(PSI // 64, PSI)], N, M, "fp32")
    assert mem["params"] == 4 * (PSI // 64 + PSI) // N
    assert mem["grads"] == 4 * (PSI // 64) // N
    assert mem["optim"] == 8 * (PSI // 64) // N
    assert memory(Strategy.parse("I", frozen=True), UNITS, N, M, "bf16") == {
        "params": 2 * PSI // M, "grads": 0, "optim": 0}


def test_padding_is_counted() -> None:
    mem = memory(Strategy.parse("GGG"), [UnitSizes(10, 3)], 4, 2, "fp32")
    assert mem["params"] == 4 * (12 + 4) // 4


def test_setup_peak_is_what_a_rank_keeps_plus_its_largest_unit_gathered() -> None:
    # Units of 10+3 and 6+0 elements on N = 4: padded 12+4 and 8; the larger gathers 16.
    units = [UnitSizes(10, 3), UnitSizes(6, 0)]
    for name, frozen in (("GGG", False), ("IGG", False), ("NNN", False), ("G", True)):
        strategy = Strategy.parse(name, frozen=frozen)
        for precision, b in (("fp32", 4), ("bf16", 2)):
            kept = sum(memory(strategy, units, 4, 2, precision).values())
            assert setup_memory(strategy, units, 4, 2, precision) == kept + 16 * b
    assert setup_memory(Strategy.parse("GGG"), [], 4, 2) == 0


def _total(name: str, s: int, phase: str) -> tuple[float, float]:
    """Table 3 is the sum over all N ranks in elements, with bf16 parameters and gradient
    reductions; traffic() averages bytes over ranks, so multiply by N and divide by 2."""
    sent = traffic(Strategy.parse(name), UNITS, N, M, s, "bf16", reduce_dtype="bf16")[phase]
    return sent.intra * N / 2, sent.inter * N / 2


def test_zero3_rows_of_table_3() -> None:
    s = 8
    ring = PSI / N * (N - 1)
    for phase in ("forward",):
        assert _total("GGG", s, phase) == pytest.approx(((N - G) * s * ring, G * s * ring))
    # backward: the all-gather and the reduce-scatter of Table 3's two backward columns
    assert _total("GGG", s, "backward") == pytest.approx((2 * (N - G) * s * ring,
                                                          2 * G * s * ring))
    assert _total("GGG", s, "boundary")[0] > 0  # only the 4-byte norm all-reduce
    assert _total("GGG", s, "boundary")[0] < 1e6


def test_zero2_rows_of_table_3() -> None:
    s = 8
    ring = PSI / N * (N - 1)
    assert _total("NGG", s, "forward") == (0, 0)
    assert _total("NGG", s, "backward") == pytest.approx(((N - G) * s * ring, G * s * ring))
    assert _total("NGG", 8, "update") == pytest.approx(((N - G) * ring, G * ring))


def test_intra_sharded_parameters_gather_only_inside_groups() -> None:
    s = 8
    for name in ("III", "IGG", "IIG"):
        intra, inter = _total(name, s, "forward")
        assert inter == 0
        assert intra == pytest.approx(N * s * PSI / M * (M - 1))  # Table 3's A-G(P) column


def test_two_step_reduce_scatter_saves_equation_1() -> None:
    # NGG reduce-scatters on the world every micro-batch; NIG reduce-scatters inside the group
    # every micro-batch and across groups once per step. Per rank, eq. (1) of the paper:
    # dC = s*Psi/N*(N-1) - (s*Psi/M*(M-1) + Psi/N*(g-1)) = Psi*(s-1)*(g-1)/N.
    s = 8
    def per_rank(name: str) -> float:
        t = traffic(Strategy.parse(name), UNITS, N, M, s, "bf16", reduce_dtype="bf16")
        return (sum(t["backward"]) + sum(t["boundary"])) / 2  # bytes -> elements
    # Both have OS = G, so their gradient-norm all-reduces are the same and cancel.
    saving = per_rank("NGG") - per_rank("NIG")
    assert saving == pytest.approx(PSI * (s - 1) * (G - 1) / N, rel=0, abs=1e-3)
