"""The closed forms of cost.py against the paper's Table 2, Table 3 (as corrected in
docs/paper-errata.md) and equation (1)."""

import pytest

from rlhf_paro.sharding.cost import UnitSizes, memory, offload_memory, setup_memory, traffic
from rlhf_paro.sharding.strategy import Strategy, all_strategies

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


@pytest.mark.parametrize("precision,b", [("fp32", 4), ("bf16", 2)])
def test_offload_moves_os_or_p_to_the_host(precision: str, b: int) -> None:
    iig, frozen = Strategy.parse("IIG"), Strategy.parse("I", frozen=True)
    # optimizer: the OS shard's fp32 master (its own, for fp32 too) and two moments, 12 bytes,
    # and a 4-byte copy of its gradient leave the device; P and G stay.
    assert offload_memory(iig, UNITS, N, M, precision, "optimizer") == {
        "params": b * PSI // M, "grads": 4 * PSI // M, "optim": 0,
        "host_params": 0, "host_grads": 4 * PSI // N, "host_optim": 12 * PSI // N}
    # params: P parked in host memory between phases, G and OS stay.
    assert offload_memory(iig, UNITS, N, M, precision, "params") == {
        **memory(iig, UNITS, N, M, precision), "params": 0, "host_params": b * PSI // M,
        "host_grads": 0, "host_optim": 0}
    assert offload_memory(frozen, UNITS, N, M, precision, "params")["params"] == 0
    with pytest.raises(ValueError, match="needs a trained model"):
        offload_memory(frozen, UNITS, N, M, precision, "optimizer")
    # Setting up with offload=optimizer, the OS is made on the host; with params, P is filled
    # on the device before it is parked.
    units = [UnitSizes(10, 3), UnitSizes(6, 0)]  # padded 12+4 and 8; the larger gathers 16
    assert setup_memory(iig, units, 4, 2, precision, "optimizer") == \
        b * (12 + 4 + 8) // 2 + 4 * (12 + 8) // 2 + 16 * b  # P and G cut in M = 2
    assert setup_memory(iig, units, 4, 2, precision, "params") == setup_memory(
        iig, units, 4, 2, precision)


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


# --- every phase of all 14 strategies against closed forms ---------------------------------------
# Written from the paper's section 3 (what each level means) with the corrections of
# docs/paper-errata.md, independently of schedule.py: totals over the N ranks, in elements,
# Table 3's notation. A buffer x moved by a ring over n ranks costs each rank (n-1)/n of x.
S = 8  # micro-batches per step


def _world(x: float, algorithm: str) -> tuple[float, float]:
    """A world all-gather or reduce-scatter of a buffer of x elements: (intra, inter)."""
    if algorithm == "native":  # the ring in rank order: g of the N ranks cross groups
        return (N - G) * x / N * (N - 1), G * x / N * (N - 1)
    # HO-Ring: every rank sends g(M-1) chunks of x/N inside its group and g-1 across groups.
    # So does auto: on this cluster every world collective is a two-level ring (its chunks of
    # Psi/N elements are far above the sizes where it picks native, comm/auto.py).
    return N * G * (M - 1) * x / N, N * (G - 1) * x / N


def _intra(x: float) -> tuple[float, float]:  # N <-> I on a buffer of x: Table 3's N x/M (M-1)
    return N * x / M * (M - 1), 0.0


def _inter(x: float) -> tuple[float, float]:  # I <-> G on the I-shard x/M: N x/N (g-1), all dagger
    return 0.0, N * x / N * (G - 1)


def _all_reduce_world(x: float) -> tuple[float, float]:  # native ring, both halves
    return 2 * (N - G) * x / N * (N - 1), 2 * G * x / N * (N - 1)


def _all_reduce_inter(x: float) -> tuple[float, float]:  # over the g replicas of an I-shard x/M
    return 0.0, 2 * N * x / N * (G - 1)


def _sum(*terms: tuple[float, float]) -> tuple[float, float]:
    return sum(t[0] for t in terms), sum(t[1] for t in terms)


NONE = (0.0, 0.0)


def closed_forms(algorithm: str) -> dict[str, dict[str, list[tuple[str, tuple[float, float]]]]]:
    """Per strategy and phase, the collectives as (what, (intra, inter) elements summed over
    ranks) for one step of S micro-batches; "p" moves parameters, "g" gradients (each Psi
    elements). The norm is left out (below)."""
    w, a, e = _world(PSI, algorithm), _intra(PSI), _inter(PSI)
    ar_inter = _all_reduce_inter(PSI)

    def micro(term: tuple[float, float]) -> tuple[float, float]:
        return S * term[0], S * term[1]

    return {
        "NNN": dict(boundary=[("g", _all_reduce_world(PSI))]),
        "NNI": dict(boundary=[("g", a), ("g", ar_inter)], update=[("p", a)]),
        "NNG": dict(boundary=[("g", w)], update=[("p", w)]),
        "NII": dict(backward=[("g", micro(a))], boundary=[("g", ar_inter)], update=[("p", a)]),
        "NIG": dict(backward=[("g", micro(a))], boundary=[("g", e)], update=[("p", w)]),
        "NGG": dict(backward=[("g", micro(w))], update=[("p", w)]),
        "INI": dict(forward=[("p", micro(a))], backward=[("p", micro(a))],
                    boundary=[("g", a), ("g", ar_inter)]),
        "ING": dict(forward=[("p", micro(a))], backward=[("p", micro(a))],
                    boundary=[("g", w)], update=[("p", e)]),
        "III": dict(forward=[("p", micro(a))], backward=[("p", micro(a)), ("g", micro(a))],
                    boundary=[("g", ar_inter)]),
        "IIG": dict(forward=[("p", micro(a))], backward=[("p", micro(a)), ("g", micro(a))],
                    boundary=[("g", e)], update=[("p", e)]),
        "IGG": dict(forward=[("p", micro(a))], backward=[("p", micro(a)), ("g", micro(w))],
                    update=[("p", e)]),
        "GNG": dict(forward=[("p", micro(w))], backward=[("p", micro(w))],
                    boundary=[("g", w)]),
        "GIG": dict(forward=[("p", micro(w))], backward=[("p", micro(w)), ("g", micro(a))],
                    boundary=[("g", e)]),
        "GGG": dict(forward=[("p", micro(w))], backward=[("p", micro(w)), ("g", micro(w))]),
    }


def _norm_bytes(optim: str) -> tuple[float, float]:
    """The fp32 squared norm (one element, a chunk of one element per rank and ring step)
    all-reduced over the OS level's shards, summed over ranks, in bytes."""
    if optim == "N":
        return NONE
    if optim == "I":
        return N * 2 * (M - 1) * 4.0, 0.0
    return (N - G) * 2 * (N - 1) * 4.0, G * 2 * (N - 1) * 4.0


@pytest.mark.parametrize("algorithm", ["native", "horing", "auto"])
@pytest.mark.parametrize("reduce_dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("name", [s.name for s in all_strategies()])
def test_every_phase_of_every_strategy_matches_its_closed_form(name: str, reduce_dtype: str,
                                                               algorithm: str) -> None:
    sent = traffic(Strategy.parse(name), UNITS, N, M, S, "bf16", algorithm,
                   reduce_dtype=reduce_dtype)
    # Bytes per element on the wire: bf16 parameters, gradients in reduce_dtype.
    size = {"p": 2, "g": 2 if reduce_dtype == "bf16" else 4}
    for phase in ("forward", "backward", "boundary", "update"):
        terms = closed_forms(algorithm)[name].get(phase, [])
        intra = sum(size[what] * t[0] for what, t in terms)
        inter = sum(size[what] * t[1] for what, t in terms)
        if phase == "boundary":
            intra, inter = _sum((intra, inter), _norm_bytes(name[2]))
        got = sent[phase]
        assert (got.intra * N, got.inter * N) == pytest.approx((intra, inter), rel=1e-12), phase


# --- the errata (docs/paper-errata.md): Table 3 as printed against what the code counts -------
def _elements(name: str, phase: str, algorithm: str = "horing") -> tuple[float, float]:
    """Table 3's quantity: (intra, inter) elements summed over ranks, bf16 everywhere, the
    fp32 norm left out."""
    sent = traffic(Strategy.parse(name), UNITS, N, M, S, "bf16", algorithm,
                   reduce_dtype="bf16")[phase]
    intra, inter = sent.intra * N, sent.inter * N
    if phase == "boundary":
        intra, inter = intra - _norm_bytes(name[2])[0], inter - _norm_bytes(name[2])[1]
    return intra / 2, inter / 2


def test_erratum_igg_backward_inter_traffic_is_psi_over_n() -> None:
    # Printed: N s Psi/M (g-1) across groups. A world reduce-scatter (HO-Ring) sends each
    # rank's g-1 chunks of Psi/N across groups, M times less.
    printed = N * S * PSI / M * (G - 1)
    assert _elements("IGG", "backward")[1] == pytest.approx(printed / M, rel=1e-12)


def test_erratum_igg_update_runs_once_per_step() -> None:
    # Printed: N s Psi/N (g-1), as if the update all-gather ran every micro-batch; it runs
    # once, after the optimizer step.
    printed = N * S * PSI / N * (G - 1)
    assert _elements("IGG", "update") == pytest.approx((0, printed / S), rel=1e-12)


def test_erratum_nig_backward_reduce_scatters_every_micro_batch() -> None:
    # Printed: N Psi/M (M-1), without s; the gradient is reduce-scattered inside the group
    # after every micro-batch's backward (section 3.3 says so itself).
    printed = N * PSI / M * (M - 1)
    assert _elements("NIG", "backward") == pytest.approx((S * printed, 0), rel=1e-12)


def test_erratum_mics_update_all_reduce_stays_between_groups() -> None:
    # Printed: 2 g Psi/M (g-1) across groups + 2 (N-g) Psi/M (g-1) inside them, the shape of
    # a world ring's row. MiCS (III) all-reduces each rank's Psi/M shard with its g replicas,
    # one per group, over the rank's own NIC: 2 (g-1)/g Psi/M per rank, N of them, and nothing
    # inside a group. The printed inter term is g/M times that (equal here, where g = M).
    printed = 2 * (N - G) * PSI / M * (G - 1), 2 * G * PSI / M * (G - 1)
    got = _elements("III", "boundary")
    assert got == pytest.approx((0, 2 * N * PSI / M * (G - 1) / G), rel=1e-12)
    assert got[1] == pytest.approx(printed[1] * M / G, rel=1e-12) and printed[0] > 0


def test_deliberate_difference_zero1_reduce_scatters_at_the_boundary() -> None:
    # Printed: an all-reduce of the gradient (2 x the ring). With OS = G a rank needs only its
    # own shard of the summed gradient: a reduce-scatter, half the bytes; the update's
    # all-gather then brings every rank the new parameters, as Table 3's A-G(P) column says.
    ring = (N - G) * PSI / N * (N - 1), G * PSI / N * (N - 1)
    assert _elements("NNG", "boundary", "native") == pytest.approx(ring, rel=1e-12)
    assert _elements("NNG", "update", "native") == pytest.approx(ring, rel=1e-12)


def test_nig_update_is_table_3s_two_step_all_gather_on_horing() -> None:
    # Not an erratum: Table 3's NIG update, N Psi/N (g-1) across + N Psi/M (M-1) inside, is
    # what HO-Ring's world all-gather sends; the native ring sends the ZeRO-2 row instead.
    printed = N * PSI / M * (M - 1), N * PSI / N * (G - 1)
    assert _elements("NIG", "update") == pytest.approx(printed, rel=1e-12)
    assert _elements("NIG", "update", "native") == pytest.approx(
        ((N - G) * PSI / N * (N - 1), G * PSI / N * (N - 1)), rel=1e-12)


# --- the sync into a rollout engine: one gather of every unit at the P level --------------------
def sync_bytes(level: str, units: list[UnitSizes], n: int, m: int, elem: int, algorithm: str,
               rank: int) -> tuple[int, int]:
    """What rank ``rank`` sends to sync once (engine.unit_parameters), (intra, inter) bytes,
    written from the levels' meaning: each unit's trainable and frozen flat buffers, each padded
    up to a multiple of N, gathered from their P shards."""
    g = n // m
    x = elem * sum(-(-size // n) * n for u in units for size in (u.trainable, u.frozen))
    if level == "N":  # every rank holds the full buffers: nothing to gather
        return 0, 0
    if level == "I":  # a ring over the M ranks of the group, each sending M-1 shards of x/M
        return (m - 1) * x // m, 0
    if algorithm == "native":  # the world ring in rank order: the group's last rank crosses
        sent = (n - 1) * x // n
        return (0, sent) if g > 1 and rank % m == m - 1 else (sent, 0)
    # HO-Ring: g(M-1) chunks of x/N inside the group, g-1 across groups, on every rank.
    return g * (m - 1) * x // n, (g - 1) * x // n


# Units whose buffers N does not divide; (5, 5) on N = 4 pads each buffer to 8, 16 in all, where
# one buffer of 10 would pad to 12. A unit may have no frozen or no trainable buffer.
SYNC_UNITS = [UnitSizes(5, 5), UnitSizes(6, 0), UnitSizes(0, 7), UnitSizes(1024, 0)]


@pytest.mark.parametrize("n,m", [(4, 2), (8, 4), (6, 3), (8, 2)])
@pytest.mark.parametrize("algorithm", ["native", "horing"])
@pytest.mark.parametrize("precision,elem", [("fp32", 4), ("bf16", 2)])
def test_a_sync_sends_one_gather_of_every_unit_at_p(n: int, m: int, algorithm: str,
                                                     precision: str, elem: int) -> None:
    for name in ("NGG", "IGG", "GGG", "N", "I", "G"):
        strategy = Strategy.parse(name, frozen=len(name) == 1)
        level = name[0]
        plain = traffic(strategy, SYNC_UNITS, n, m, 2, precision, algorithm)
        assert plain["sync"] == (0, 0)  # no sync asked for
        expected = [sync_bytes(level, SYNC_UNITS, n, m, elem, algorithm, r) for r in range(n)]
        for rank in range(n):
            got = traffic(strategy, SYNC_UNITS, n, m, 2, precision, algorithm, rank=rank,
                          syncs=3)
            assert got["sync"] == tuple(3 * b for b in expected[rank]), (name, rank)
            # The sync adds a phase; the step's own phases are what they were.
            alone = traffic(strategy, SYNC_UNITS, n, m, 2, precision, algorithm, rank=rank)
            assert {k: v for k, v in got.items() if k != "sync"} == \
                {k: v for k, v in alone.items() if k != "sync"}
        mean = traffic(strategy, SYNC_UNITS, n, m, 2, precision, algorithm, syncs=1)["sync"]
        assert mean == (sum(e[0] for e in expected) / n, sum(e[1] for e in expected) / n)
    # The closed form's padding is the engine's: here (5+5) pads to 8 + 8 where 10 would to 12.
    assert sync_bytes("I", [UnitSizes(5, 5)], 4, 2, 4, "native", 0) == (4 * 16 // 2, 0)
