"""Planner: per-device memory and traffic of every strategy of every model, and what to pick.

    python -m rlhf_paro.plan [--help] [--cfg job] [-m] [conf=NAME] [override ...]
    python -m rlhf_paro.plan conf=ppo_llama7b cluster.nodes=16 cluster.gpus_per_node=8

Each model is built on the meta device (no weights, no GPU) and cut into units exactly as the
engine cuts it; ``sharding/cost.py`` gives the bytes held in P, G and OS (the paper's Table 2)
and the bytes sent on intra- and inter-group links (Table 3) for each strategy: the 14 triples
for actor and critic, the three P levels for reward and ref.

[Note: what a PPO step costs]
Traffic is counted per PPO step on one device: every model runs its inference forwards over
the device's share of the rollout (rollout / N sequences, in micro-batches), the actor also
gathers its parameters once for generation, and actor and critic each run
(rollout / mini-batch) x epochs optimizer steps of s micro-batches. Time is estimated as
intra bytes / ``cluster.intra_gbps`` + inter bytes / ``cluster.inter_gbps``, the links of one
device taken one at a time (an upper bound for overlapping algorithms such as HO-Ring).

[Note: all four models share a device]
Every device holds its shard of all four models, so a strategy only fits together with the
other three: the planner searches every combination (14 x 14 x 3 x 3) for the lowest estimated
time whose P + G + OS sum stays within ``memory_gb`` x (1 - ``activation_reserve``). A strategy
is marked as fitting when some combination that contains it fits.

[Note: setup peak]
The four models set up at the same time, each rank reading only its shards from the model's
files one unit at a time; a model then holds at most its P + G + OS plus its largest unit
gathered (``cost.setup_memory``, the engine's [Note: setup memory]). A fitting combination's
four setup peaks must also fit in ``memory_gb`` (no activations exist yet, so the reserve is
free then).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import sys
from dataclasses import dataclass

from rlhf_paro import cli
from rlhf_paro.config import FROZEN_ROLES, ROLES, TRAINED_ROLES, Config, ConfigError
from rlhf_paro.sharding.strategy import Level, Strategy, all_strategies

GIB = 2 ** 30
GB = 1e9


@dataclass(frozen=True)
class Option:
    """One strategy of one model on one device."""

    strategy: Strategy
    params_bytes: int
    grads_bytes: int
    optim_bytes: int
    setup_bytes: int  # held at most while setting up: P + G + OS + one unit gathered
    intra_bytes: float  # sent per PPO step
    inter_bytes: float
    seconds: float  # estimated link time per PPO step

    @property
    def memory_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.optim_bytes


@dataclass
class ModelPlan:
    role: str
    num_params: int  # Psi
    num_trainable: int  # Psi'
    options: list[Option]

    def option(self, strategy: Strategy) -> Option:
        return next(o for o in self.options if o.strategy == strategy)


@dataclass
class Plan:
    models: dict[str, ModelPlan]
    budget_bytes: float  # per device, for the four models' P + G + OS
    device_bytes: float  # per device, for the four models' setup peaks ([Note: setup peak])
    best: dict[str, Option] | None  # lowest estimated time that fits; None when nothing fits
    fits: dict[str, set[Strategy]]  # per model, the strategies of some fitting combination


def frozen_strategies() -> list[Strategy]:
    return [Strategy(level) for level in Level]


def _inference_passes(cfg: Config, role: str) -> int:
    per_device = cfg.ppo.rollout_batch_size // cfg.cluster.num_devices
    passes = math.ceil(per_device / cfg.model(role).micro_batch_size)
    # The actor gathers its parameters once more, for the whole generation.
    return passes + 1 if role == "actor" else passes


def model_plan(cfg: Config, role: str, vocab_size: int) -> ModelPlan:
    """Memory and per-PPO-step traffic of every strategy of one model (see the module notes)."""
    import torch

    from rlhf_paro.models import build_model
    from rlhf_paro.sharding.cost import memory, setup_memory, traffic
    from rlhf_paro.sharding.layout import unit_sizes

    model_cfg = cfg.model(role)
    # A reward function has no model: it holds and sends nothing.
    model = (torch.nn.Module() if model_cfg.function is not None else
             build_model(role, model_cfg, vocab_size, meta=True))
    units = unit_sizes(model)
    num_params = sum(p.numel() for p in model.parameters())
    num_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    del model
    n, m, precision = cfg.cluster.num_devices, cfg.cluster.group_size, model_cfg.precision
    algorithm = cfg.comm.algorithm
    trained = role in TRAINED_ROLES
    optimizer_steps = (cfg.ppo.rollout_batch_size // cfg.ppo.mini_batch_size) * cfg.ppo.ppo_epochs
    inference = {}  # P level -> per-step bytes of the inference forwards, shared by triples
    for level in Level:
        phases = traffic(Strategy(level), units, n, m, _inference_passes(cfg, role), precision,
                         algorithm)
        inference[level] = (sum(p.intra for p in phases.values()),
                            sum(p.inter for p in phases.values()))
    options = []
    for strategy in all_strategies() if trained else frozen_strategies():
        held = memory(strategy, units, n, m, precision)
        intra, inter = inference[strategy.params]
        if trained:
            phases = traffic(strategy, units, n, m, cfg.grad_accum_steps(role), precision,
                             algorithm, reduce_dtype=model_cfg.reduce_dtype)
            intra += optimizer_steps * sum(p.intra for p in phases.values())
            inter += optimizer_steps * sum(p.inter for p in phases.values())
        seconds = intra / (cfg.cluster.intra_gbps * GB) + inter / (cfg.cluster.inter_gbps * GB)
        setup = setup_memory(strategy, units, n, m, precision)
        options.append(Option(strategy, held["params"], held["grads"], held["optim"], setup,
                              intra, inter, seconds))
    return ModelPlan(role, num_params, num_trainable, options)


def _budget(cfg: Config, reserve: float) -> float:
    if cfg.cluster.memory_gb is None:
        return math.inf
    return cfg.cluster.memory_gb * GIB * (1.0 - reserve)


def _search(models: dict[str, ModelPlan], budget: float, device: float,
            fixed: dict[str, Strategy]
            ) -> tuple[dict[str, Option] | None, dict[str, set[Strategy]]]:
    """Lowest-time fitting combination (ties: less memory), and each model's fitting options."""
    choices = [[models[r].option(fixed[r])] if r in fixed else models[r].options for r in ROLES]
    best, best_key = None, None
    fits: dict[str, set[Strategy]] = {r: set() for r in ROLES}
    for combo in itertools.product(*choices):
        used = sum(o.memory_bytes for o in combo)
        if used > budget or sum(o.setup_bytes for o in combo) > device:
            continue
        for role, option in zip(ROLES, combo):
            fits[role].add(option.strategy)
        key = (round(sum(o.seconds for o in combo), 6), used)
        if best_key is None or key < best_key:
            best, best_key = dict(zip(ROLES, combo)), key
    return best, fits


def make_plan(cfg: Config, vocab_sizes: dict[str, int] | None = None,
              fixed: dict[str, Strategy] | None = None) -> Plan:
    """Plan all four models; ``fixed`` pins the strategies of some of them; ``vocab_sizes``:
    ``ppo.data.vocab_sizes`` (read here when not given)."""
    if vocab_sizes is None:
        from rlhf_paro.ppo.data import vocab_sizes as read_vocab_sizes

        vocab_sizes = read_vocab_sizes(cfg)
    models = {role: model_plan(cfg, role, vocab_sizes[role]) for role in ROLES}
    budget, device = _budget(cfg, cfg.cluster.activation_reserve), _budget(cfg, 0.0)
    best, fits = _search(models, budget, device, fixed or {})
    return Plan(models, budget, device, best, fits)


def configured_strategies(cfg: Config) -> dict[str, Strategy]:
    """The strategies the conf sets (roles left at ``auto`` are absent)."""
    return {role: Strategy.parse(cfg.model(role).strategy, frozen=role in FROZEN_ROLES)
            for role in ROLES if cfg.model(role).strategy != "auto"}


def choose_strategies(cfg: Config, vocab_sizes: dict[str, int] | None = None
                      ) -> dict[str, Strategy]:
    """A strategy for every role: the conf's where it sets one, the planner's for ``auto``.

    The ``auto`` roles get the lowest estimated traffic time such that all four models fit in
    ``cluster.memory_gb``; raises ``ConfigError`` when no choice fits.
    """
    fixed = configured_strategies(cfg)
    if len(fixed) == len(ROLES):
        return fixed
    plan = make_plan(cfg, vocab_sizes, fixed)
    if plan.best is None:
        auto = [r for r in ROLES if r not in fixed]
        raise ConfigError(f"{auto[0]}.strategy", "auto found no strategy with which all four "
                          f"models fit in cluster.memory_gb={cfg.cluster.memory_gb}; allowed: "
                          "more devices or memory, or see python -m rlhf_paro.plan")
    return {role: plan.best[role].strategy for role in ROLES}


def resolve_auto(cfg: Config, vocab_sizes: dict[str, int] | None = None) -> Config:
    """``cfg`` with every ``auto`` strategy replaced by the planner's choice."""
    chosen = choose_strategies(cfg, vocab_sizes)
    resolved = dataclasses.replace(cfg)
    for role in ROLES:
        setattr(resolved, role, dataclasses.replace(cfg.model(role), strategy=chosen[role].name))
    return resolved


# --- report -------------------------------------------------------------------------------------

def _time_key(option: Option) -> tuple[float, int]:
    # Times within a microsecond are a tie (float noise of equal traffic): less memory wins.
    return round(option.seconds, 6), option.memory_bytes


def _why(plan: Plan, role: str) -> str:
    """One line: why this model got its recommended strategy."""
    chosen = plan.best[role]
    model = plan.models[role]
    fastest = min(model.options, key=_time_key)
    if _time_key(fastest)[0] >= _time_key(chosen)[0]:
        return (f"{chosen.strategy}: least link time of its {len(model.options)} strategies "
                f"({chosen.seconds:.3g} s/step; ties go to less memory)")
    extra = fastest.memory_bytes - chosen.memory_bytes
    return (f"{chosen.strategy}: {fastest.strategy} would send less ({fastest.seconds:.3g} vs "
            f"{chosen.seconds:.3g} s/step) but needs {extra / GIB:.2f} GiB more: the four would "
            "not fit")


def format_plan(cfg: Config, plan: Plan) -> str:
    c = cfg.cluster
    budget = "unlimited" if math.isinf(plan.budget_bytes) else (
        f"{plan.budget_bytes / GIB:.1f} GiB of {c.memory_gb:g} GiB (reserve "
        f"{c.activation_reserve:.0%} for activations)")
    lines = [
        f"cluster: N={c.num_devices} devices, M={c.group_size} per group, g={c.num_groups} "
        f"groups, {c.device}; links {c.intra_gbps:g} GB/s intra, {c.inter_gbps:g} GB/s inter; "
        f"comm {cfg.comm.algorithm}",
        f"memory for the four models per device: {budget}",
        f"PPO step: rollout {cfg.ppo.rollout_batch_size}, mini-batch {cfg.ppo.mini_batch_size}, "
        f"{cfg.ppo.ppo_epochs} epoch(s); traffic is bytes one device sends per PPO step",
    ]
    configured = configured_strategies(cfg)
    # Tiny models read better in MiB/MB, real ones in GiB/GB.
    big = max(o.memory_bytes for m in plan.models.values() for o in m.options) >= GIB
    mem_unit, mem_scale = ("GiB", GIB) if big else ("MiB", 2 ** 20)
    net_unit, net_scale = ("GB", GB) if big else ("MB", 1e6)
    for role in ROLES:
        model = plan.models[role]
        m_cfg = cfg.model(role)
        steps = f", s={cfg.grad_accum_steps(role)}" if role in TRAINED_ROLES else ""
        lines += ["", f"{role}: Psi={model.num_params:,} Psi'={model.num_trainable:,} "
                      f"{m_cfg.precision}{steps}, conf strategy {m_cfg.strategy}",
                  f"  strategy  {'P':>7} {'G':>8} {'OS':>8} {'sum':>8} {'setup':>8} "
                  f"{'intra':>9} {'inter':>9}  link s/step  fits",
                  f"            {mem_unit:>7} {mem_unit:>8} {mem_unit:>8} {mem_unit:>8} "
                  f"{mem_unit:>8} {net_unit:>9} {net_unit:>9}"]
        for o in model.options:
            marks = "yes" if o.strategy in plan.fits[role] else "no"
            if plan.best is not None and plan.best[role].strategy == o.strategy:
                marks += "  <- recommended"
            if configured.get(role) == o.strategy:
                marks += "  (conf)"
            held = [o.params_bytes, o.grads_bytes, o.optim_bytes, o.memory_bytes, o.setup_bytes]
            cells = " ".join(f"{b / mem_scale:8.2f}" for b in held)
            sent = " ".join(f"{b / net_scale:9.3f}" for b in (o.intra_bytes, o.inter_bytes))
            lines.append(f"  {o.strategy.name:<8}{cells} {sent} {o.seconds:12.4g}  {marks}")
    lines.append("")
    if plan.best is None:
        leanest = sum(min(o.memory_bytes for o in plan.models[r].options) for r in ROLES)
        lines.append(f"no combination fits: the leanest needs {leanest / GIB:.1f} GiB per "
                     "device; add devices or memory, or use LoRA for the actor")
    else:
        used = sum(o.memory_bytes for o in plan.best.values())
        room = "" if math.isinf(plan.budget_bytes) else \
            f" (the four models hold {used / GIB:.1f} of {plan.budget_bytes / GIB:.1f} GiB)"
        lines.append(f"recommended{room}:")
        lines += [f"  {role:<7}{_why(plan, role)}" for role in ROLES]
        setup = sum(o.setup_bytes for o in plan.best.values())
        lines.append(f"setup peak: {setup / mem_scale:.2f} {mem_unit} per device while the four "
                     "models set up at once (each its P + G + OS and one unit gathered)")
        if len(configured) == len(ROLES):
            chosen = [plan.models[r].option(configured[r]) for r in ROLES]
            used = sum(o.memory_bytes for o in chosen)
            setup = sum(o.setup_bytes for o in chosen)
            verdict = "fits" if used <= plan.budget_bytes else "does NOT fit"
            during = "fits" if setup <= plan.device_bytes else "does NOT fit"
            lines.append(f"the conf's strategies hold {used / GIB:.1f} GiB per device: {verdict}; "
                         f"setup peak {setup / mem_scale:.2f} {mem_unit}: {during}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    cli.main(sys.argv[1:] if argv is None else argv, prog="rlhf_paro.plan", about=_ABOUT,
             prepare=_check_models, execute=lambda cfg, _: print(format_plan(cfg, make_plan(cfg))))


# --help: the first paragraph of the module docstring.
_ABOUT = __doc__.split("\n\n")[0]


def _check_models(cfg: Config, conf: str) -> Config:
    from rlhf_paro.models import check_model_configs
    from rlhf_paro.ppo.data import vocab_sizes

    check_model_configs(cfg, vocab_sizes(cfg))
    return cfg


if __name__ == "__main__":
    main()
