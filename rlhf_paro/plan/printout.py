"""The planner's printout: the cluster, every model's strategies in a table, the recommended
combination with why, and the step (``format_plan``)."""

from __future__ import annotations

import math

from rlhf_paro.config import OFFLOAD_ALLOWED, TRAINED_ROLES, Config
from rlhf_paro.plan.cost import (GB, GIB, ModelPlan, Option, budget_split, expected_tokens,
                                 samples_per_device)
from rlhf_paro.plan.search import COUNT, Plan, configured_strategies
from rlhf_paro.plan.step import Split, generation, predict_step

# The planner table's offload columns: device bytes between phases under each mode.
OFFLOAD_COLUMNS = {"none": "none", "optimizer": "opt", "params": "par"}


def _time_key(seconds: float, memory_bytes: int) -> tuple[float, int]:
    # Times within a microsecond are a tie (float noise of equal work): less memory wins.
    return round(seconds, 6), memory_bytes


def _alone(plan: Plan, model: ModelPlan) -> list[Option]:
    """The model's options that fit the device with the device to itself, fastest first."""
    fitting = [o for o in model.options
               if o.memory_bytes + o.configured.peak_bytes <= plan.budget_bytes]
    return sorted(fitting, key=lambda o: _time_key(o.seconds, o.memory_bytes))


def _why(plan: Plan, role: str) -> str:
    """One line: why this model got its recommended strategy, in predicted times."""
    chosen = plan.best[role]
    model = plan.models[role]
    t = chosen.timed
    grown = "" if chosen.micro_batch == next(iter(chosen.option.by_micro)) else \
        f", micro-batch grown to {chosen.micro_batch}"
    sync = model.sync.get(chosen.strategy.params)
    synced = "" if sync is None else f", of which the sync {sync.seconds:.3g} s" \
        if sync.seconds else f", the sync nothing at P={chosen.strategy.params.name}"
    head = (f"{chosen.strategy}: {t.seconds:.4g} s/PPO step predicted (compute "
            f"{t.compute:.3g} s, exposed communication {t.exposed:.3g} s{synced}{grown})")
    faster = [o for o in model.options
              if _time_key(o.seconds, o.memory_bytes) < _time_key(t.seconds, chosen.memory_bytes)
              and o.strategy != chosen.strategy]
    if not faster:
        return f"{head}; the least of its {len(model.options)} strategies"
    fastest = min(faster, key=lambda o: _time_key(o.seconds, o.memory_bytes))
    extra = fastest.memory_bytes - chosen.memory_bytes
    if extra <= 0:  # offload=params: the same resident states, but more brought back to run
        extra = fastest.configured.peak_bytes - t.peak_bytes
        return (f"{head}; {fastest.strategy} would take {fastest.seconds:.4g} s but needs "
                f"{extra / GIB:+.2f} GiB more while it runs: the {COUNT[len(plan.models)]} "
                "would not fit")
    return (f"{head}; {fastest.strategy} would take {fastest.seconds:.4g} s but holds "
            f"{extra / GIB:+.2f} GiB of states: the {COUNT[len(plan.models)]} would not fit")


def _engine_lines(cfg: Config, model: ModelPlan, mem_unit: str, mem_scale: float,
                  net_unit: str, net_scale: float) -> list[str]:
    """What the actor's syncing rollout engine costs: the sync by P level ([Note: what a PPO
    step costs]) and its memory ([Note: a rollout engine's memory])."""
    by_level = "; ".join(
        f"P={level.name} " + ("nothing" if not (s.intra_bytes or s.inter_bytes) else
                              f"{s.intra_bytes / net_scale:.3f} {net_unit} intra + "
                              f"{s.inter_bytes / net_scale:.3f} {net_unit} inter, "
                              f"{s.seconds:.3g} s")
        for level, s in model.sync.items())
    engine, c = cfg.rollout.engine, cfg.cluster
    weights = f"{model.engine_weights / mem_scale:.2f} {mem_unit} of weights"
    share = cfg.rollout.gpu_memory_utilization
    if model.engine_bytes:
        taken = (f"at least {model.engine_bytes / mem_scale:.2f} {mem_unit} (rollout."
                 "gpu_memory_utilization=auto: what the chosen strategies leave, set as the run "
                 "starts)" if share == "auto" else
                 f"{model.engine_bytes / mem_scale:.2f} {mem_unit} (rollout."
                 f"gpu_memory_utilization={share:g} x cluster.memory_gb={c.memory_gb:g})")
        memory = (f"  the {engine} engine takes {taken}, {weights} and the rest for its "
                  "key/value cache, while the actor syncs and generates (in its peak and "
                  "setup); asleep in host memory while the models score and train")
    else:
        memory = (f"  the {engine} engine's {weights} and its key/value cache are not counted "
                  + ("(a CPU device)" if c.device != "cuda" else "(no cluster.memory_gb)"))
    return [f"  sync into the {engine} engine once per PPO step, every unit gathered at P's "
            f"scope, in place of generation's gather (in intra, inter and s/step): {by_level}",
            memory]


def _absent_critic_line(cfg: Config, plan: Plan, mem_unit: str, mem_scale: float) -> str:
    """What a run without a critic leaves to its models: the states of the critic PPO would
    build, at its leanest strategy (of those that fit the device alone, if any does)."""
    critic = plan.absent_critic
    fitting = _alone(plan, critic)
    leanest = min(fitting or critic.options, key=lambda o: (o.memory_bytes, round(o.seconds, 6)))
    return (f"no critic (algorithm.adv_estimator={cfg.algorithm.adv_estimator}): frees "
            f"{leanest.memory_bytes / mem_scale:.2f} {mem_unit} per device that a critic under "
            f"{leanest.strategy} (its leanest strategy{' that fits' if fitting else ''}) would "
            f"hold; the {COUNT[len(plan.models)]} models use it")


def _tokens_line(cfg: Config, plan: Plan) -> str:
    """One line: the sequence lengths the planner sized memory and compute by
    ([Note: real tokens])."""
    key, prompt = cfg.prompt_bound()
    ppo = cfg.ppo
    bound, longest = cfg.longest_sequence()
    running = [r for r in plan.models if cfg.model(r).runs_model]
    packed = [r for r in running if plan.models[r].tokens.packed]
    padded = [r for r in running if r not in packed]
    response_key, response_bound = cfg.response_bound()
    response = (f"ppo.expected_response_length={ppo.expected_response_length}"
                if ppo.expected_response_length is not None else
                f"{response_key}={response_bound}: expected_response_length null")
    compute = []
    if packed:
        compute.append(f"the expected {expected_tokens(cfg)} ({key}={prompt} + {response}) for "
                       f"{', '.join(packed)} (packed)")
    if padded:
        compute.append(f"the padded {longest} for {', '.join(padded)} (packing off)")
    episode = " (an episode: actions and observations)" if cfg.env.enabled else ""
    return (f"tokens per sequence{episode}: memory by the longest, {longest} ({bound}); "
            "compute by " + "; ".join(compute))


def _step_lines(cfg: Config, plan: Plan, mem_unit: str, mem_scale: float) -> list[str]:
    """The rollout's generation ([Note: generation time]) and the step in the order of its
    stages (``ppo/pipeline.py``)."""
    step = predict_step(cfg, plan)
    if step is None:
        return []
    actor, c, r = plan.models["actor"], cfg.cluster, cfg.rollout
    gen = generation(cfg, actor.num_params, actor.engine_weights, actor.kv_token_bytes)
    where = (f"on {r.num_devices} device(s) of its own" if r.num_devices else
             f"on the {c.num_devices} training devices")
    bound = "memory-bound" if gen.memory_bound else "compute-bound"
    lines = [f"generation ({r.engine}, {where}): {gen.engines} engine(s) of {gen.devices} "
             f"device(s), {gen.sequences} sequences each, {gen.concurrent} at a time: "
             f"{gen.steps} decoding steps of {gen.step_seconds * 1e3:.3g} ms ({bound}: "
             f"{actor.engine_weights / mem_scale:.2f} {mem_unit} of weights and the cache read "
             f"per step at "
             f"cluster.memory_gbps={c.memory_gbps:g}) + prefill {gen.prefill_seconds:.3g} s = "
             f"{gen.seconds:.4g} s"]
    sync = f"sync {step.sync:.3g} s" + (f" (of which the transfer to {r.num_devices} "
                                        f"replica(s) {step.transfer:.3g} s)" if r.num_devices
                                        else "")
    parts = (f"{sync} + max(generation {step.generate:.4g} s, training {step.train:.4g} s)"
             if r.max_staleness else
             f"{sync} + generation {step.generate:.4g} s + training {step.train:.4g} s")
    lines.append(f"step ({step.order}, rollout.max_staleness={r.max_staleness}): {parts} = "
                 f"{step.seconds:.4g} s predicted")
    return lines


def _splits_lines(cfg: Config, splits: tuple[list[Split], dict[int, str]]) -> list[str]:
    """The table over the devices given to the rollout (``rollout_splits``)."""
    rows, skipped = splits
    total = cfg.cluster.num_devices + cfg.rollout.num_devices
    k = max(1, cfg.rollout.max_staleness)
    lines = ["", f"devices for the rollout, of {total}: D for the rollout, N for training (its "
                 "strategies planned on N), seconds predicted per step",
             f"  {'D':>4} {'N':>4} {'generate':>9} {'train':>9} {'sync':>7} {'step K=0':>9} "
             f"{'step K=' + str(k):>9}"]
    fastest = None
    for row in rows:
        if row.synchronous is None:
            lines.append(f"  {row.rollout_devices:>4} {row.training_devices:>4}  no "
                         "combination fits")
            continue
        s, o = row.synchronous, row.overlapped
        best = min(s.seconds, o.seconds if o else math.inf)
        if fastest is None or best < fastest[1]:
            fastest = (row.rollout_devices, best)
        lines.append(f"  {row.rollout_devices:>4} {row.training_devices:>4} {s.generate:9.4g} "
                     f"{s.train:9.4g} {s.sync:7.3g} {s.seconds:9.4g} "
                     + (f"{o.seconds:9.4g}" if o else f"{'-':>9}"))
    if skipped:
        first = next(iter(skipped))
        lines.append(f"  D={', '.join(map(str, skipped))}: not runnable with this conf (D={first}: "
                     f"{skipped[first]})")
    if fastest is not None:
        lines.append(f"  fastest: D={fastest[0]} ({fastest[1]:.4g} s per step)")
    return lines


def format_plan(cfg: Config, plan: Plan,
                splits: tuple[list[Split], dict[int, str]] | None = None) -> str:
    c = cfg.cluster
    roles = tuple(plan.models)
    budget = "unlimited" if math.isinf(plan.budget_bytes) else (
        f"{plan.budget_bytes / GIB:.1f} GiB of {c.memory_gb:g} GiB (reserve "
        f"{c.activation_reserve:.0%} beyond modelled activations and buffers)")
    lines = [
        f"cluster: N={c.num_devices} devices, M={c.group_size} per group, g={c.num_groups} "
        f"groups, {c.device}; links {c.intra_gbps:g} GB/s + {c.intra_latency_us:g} us intra, "
        f"{c.inter_gbps:g} GB/s + {c.inter_latency_us:g} us inter; {c.tflops:g} TFLOP/s; "
        f"comm {cfg.comm.algorithm}",
        f"memory per device: {budget}",
        f"PPO step: rollout {cfg.ppo.rollout_batch_size} prompts x {cfg.rollout.n} samples, "
        f"mini-batch {cfg.ppo.mini_batch_size}, {cfg.ppo.ppo_epochs} epoch(s); models "
        f"{', '.join(roles)} (algorithm.adv_estimator={cfg.algorithm.adv_estimator}); traffic "
        "is bytes one device sends per PPO step, time is predicted per PPO step (generation's "
        "decoding apart: see step)",
        _tokens_line(cfg, plan),
        "P, G, OS, sum, peak and setup are device bytes under each model's offload; columns "
        + "/".join(OFFLOAD_COLUMNS.values()) + ": device bytes between the model's phases under "
        + "/".join(OFFLOAD_COLUMNS) + " ('-': not for this model)",
    ]
    configured = configured_strategies(cfg)
    # Tiny models read better in MiB/MB, real ones in GiB/GB.
    big = max(o.memory_bytes for m in plan.models.values() for o in m.options) >= GIB
    mem_unit, mem_scale = ("GiB", GIB) if big else ("MiB", 2 ** 20)
    net_unit, net_scale = ("GB", GB) if big else ("MB", 1e6)
    for role, model in plan.models.items():
        m_cfg = cfg.model(role)
        split = budget_split(cfg, role, model.tokens)
        steps = "" if role not in TRAINED_ROLES else f", s={cfg.grad_accum_steps(role)}" \
            if split is None else (f", s={split[1]} expected under max_tokens_per_micro_batch="
                                   f"{m_cfg.max_tokens_per_micro_batch}")
        alone = _alone(plan, model)
        rank = {o.strategy: k + 1 for k, o in enumerate(alone)}
        modes = OFFLOAD_ALLOWED[role][0]
        lines += ["", f"{role}: Psi={model.num_params:,} Psi'={model.num_trainable:,} "
                      f"{m_cfg.precision}{steps}, micro-batch {m_cfg.micro_batch_size}, conf "
                      f"strategy {m_cfg.strategy}{' (deepspeed)' if m_cfg.backend == 'deepspeed' else ''}, "
                      f"offload {cfg.offload(role)}; fastest first "
                      "(rank: alone on the device)",
                  f"  rank strategy {'P':>7} {'G':>8} {'OS':>8} {'sum':>8} {'peak':>8} "
                  f"{'setup':>8} "
                  + "".join(f"{OFFLOAD_COLUMNS[mode]:>8} " for mode in OFFLOAD_COLUMNS)
                  + f"{'intra':>9} {'inter':>9} {'s/step':>9} {'compute':>8} {'exposed':>8}  fits",
                  f"                {mem_unit:>7} {mem_unit:>8} {mem_unit:>8} {mem_unit:>8} "
                  f"{mem_unit:>8} {mem_unit:>8} "
                  + "".join(f"{mem_unit if mode in modes else '':>8} " for mode in OFFLOAD_COLUMNS)
                  + f"{net_unit:>9} {net_unit:>9}"]
        for o in sorted(model.options, key=lambda o: _time_key(o.seconds, o.memory_bytes)):
            marks = "yes" if o.strategy in plan.fits[role] else "no"
            if plan.best is not None and plan.best[role].strategy == o.strategy:
                marks += "  <- recommended"
            if configured.get(role) == o.strategy:
                marks += "  (conf)"
            held = [o.params_bytes, o.grads_bytes, o.optim_bytes, o.memory_bytes,
                    o.memory_bytes + o.configured.peak_bytes, o.setup_bytes]
            cells = " ".join(f"{b / mem_scale:8.2f}" for b in held)
            cells += "".join(f" {o.device_by_offload[mode] / mem_scale:8.2f}"
                             if mode in o.device_by_offload else f" {'-':>8}"
                             for mode in OFFLOAD_COLUMNS)
            sent = " ".join(f"{b / net_scale:9.3f}" for b in (o.intra_bytes, o.inter_bytes))
            t = o.configured
            lines.append(f"  {rank.get(o.strategy, '-')!s:>4} {o.strategy.name:<7}{cells} {sent} "
                         f"{t.seconds:9.4g} {t.compute:8.3g} {t.exposed:8.3g}  {marks}")
        if m_cfg.offload != "none":
            shown = plan.best[role].option if plan.best is not None else min(
                model.options, key=lambda o: o.memory_bytes)
            lines.append(f"  offload={m_cfg.offload}: {shown.strategy} also holds "
                         f"{shown.host_bytes / mem_scale:.2f} {mem_unit} in host memory per "
                         "device")
        if model.sync:
            lines += _engine_lines(cfg, model, mem_unit, mem_scale, net_unit, net_scale)
        elif model.kv_cache_bytes:
            lines.append(f"  generation also holds a key/value cache of "
                         f"{model.kv_cache_bytes / mem_scale:.1f} {mem_unit} for the device's "
                         f"{samples_per_device(cfg)} samples at once, not counted in any peak")
    lines.append("")
    if plan.absent_critic is not None:
        lines.append(_absent_critic_line(cfg, plan, mem_unit, mem_scale))
    count = COUNT[len(roles)]
    if plan.best is None:
        leanest = sum(min(o.memory_bytes for o in m.options) for m in plan.models.values())
        engine = plan.models["actor"].engine_bytes
        lines.append(f"no combination fits: the leanest states need {leanest / GIB:.1f} GiB "
                     "per device" + (f", the rollout engine {engine / GIB:.1f} GiB more while "
                                     "it generates" if engine else "")
                     + "; add devices or memory, or use LoRA for the actor"
                     + (", or lower rollout.gpu_memory_utilization" if engine else ""))
    else:
        states = sum(ch.memory_bytes for ch in plan.best.values())
        peak = max(ch.timed.peak_bytes for ch in plan.best.values())
        total = sum(ch.seconds for ch in plan.best.values())
        room = "" if math.isinf(plan.budget_bytes) else \
            (f"; the {count} hold {states / GIB:.1f} GiB of states, {(states + peak) / GIB:.1f} "
             f"GiB at the peak, of {plan.budget_bytes / GIB:.1f} GiB")
        lines.append(f"recommended ({total:.4g} s per PPO step predicted{room}):")
        lines += [f"  {role:<7}{_why(plan, role)}" for role in roles]
        setup = sum(ch.option.setup_bytes for ch in plan.best.values())
        engine = ", and the actor's rollout engine its share" if \
            plan.models["actor"].engine_bytes else ""
        lines.append(f"setup peak: {setup / mem_scale:.2f} {mem_unit} per device while the "
                     f"{count} models set up at once (each its P + G + OS and one unit "
                     f"gathered{engine})")
        if len(configured) == len(roles):
            picked = [plan.models[r].option(configured[r]) for r in roles]
            states = sum(o.memory_bytes for o in picked)
            fits = all(o.best_within(plan.budget_bytes - states) for o in picked)
            seconds = sum(o.seconds for o in picked)
            setup = sum(o.setup_bytes for o in picked)
            during = "fits" if setup <= plan.device_bytes else "does NOT fit"
            lines.append(f"the conf's strategies: {seconds:.4g} s per PPO step predicted, "
                         f"{states / GIB:.1f} GiB of states per device: "
                         f"{'fits' if fits else 'does NOT fit'}; setup peak "
                         f"{setup / mem_scale:.2f} {mem_unit}: {during}")
        lines += _step_lines(cfg, plan, mem_unit, mem_scale)
    if splits is not None:
        lines += _splits_lines(cfg, splits)
    return "\n".join(lines)
