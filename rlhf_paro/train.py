"""RLHF PPO on Ray, a PaRO sharding strategy per model.

With no arguments it runs conf/ppo_tiny.yaml on this machine's CPUs (no GPU, no network). Size
a cluster first with `python -m rlhf_paro.plan`.

Ctrl-C stops a run at once (exit 130), SIGTERM after the step in progress, with a checkpoint
(exit 143; docs/design.md, "Faults"); either says so in one line, from the first second on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shlex
import signal
import sys
from types import FrameType
from typing import Iterator, Mapping

from rlhf_paro import cli
from rlhf_paro.config import RAY_ADDRESS_ALLOWED, Config, ConfigError


def _stop_before_the_run(signum: int, frame: FrameType | None) -> None:
    """SIGINT or SIGTERM before a run started (reading the config, making the demo): one line
    and the signal's exit status at once. Nothing has started that needs stopping, and an
    exception raised from here could land in a ``__del__``, where Python only prints it and
    goes on (seen on a loaded machine)."""
    word = "interrupted" if signum == signal.SIGINT else "terminated (SIGTERM)"
    print(f"error: {word} before the run started", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(128 + signum)


def main(argv: list[str] | None = None) -> None:
    previous = {sig: signal.signal(sig, _stop_before_the_run)
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        cli.main(sys.argv[1:] if argv is None else argv, prog="rlhf_paro.train",
                 about=__doc__, prepare=prepare, execute=run)
    finally:  # a caller in the same process gets its own handlers back
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def prepare(cfg: Config, conf: str) -> Config:
    """Every check a user's mistake can fail, before anything runs or is written; the config to
    run: resolved (``rlhf_paro.resolve``: the demo made, files checked, derived values set), with
    ``auto`` strategies chosen and ``ray.address`` taken from the environment."""
    cfg = with_ray_address(cfg, os.environ)
    from rlhf_paro import runs

    # The output directory's refusals come first: a user who reused a folder hears it in
    # seconds, not after the models were read.
    runs.check_output_dir(cfg.trainer.output_dir)
    runs.check_unlocked(cfg.trainer.output_dir)
    runs.check_definition(cfg)
    require_gpus(cfg, conf)
    if cfg.ray.address:
        require_ray(cfg.ray.address)
    else:  # a private Ray's workers fork from a zygote, which imports while this reads on
        from rlhf_paro.actors.group import start_worker_zygote

        start_worker_zygote()
    # Everything below needs transformers; a bad command line has failed before it.
    from rlhf_paro import models, plan
    from rlhf_paro.resolve import resolve

    with quiet_vllm_import():
        cfg = resolve(cfg)
    vocab_sizes = runs.check_inputs(cfg)
    models.check_model_configs(cfg, vocab_sizes)
    return plan.resolve_auto(cfg, vocab_sizes)


@contextlib.contextmanager
def quiet_vllm_import() -> Iterator[None]:
    """vLLM's warnings off while the engine check imports it in this process (its note on
    Triton, which a CPU build does without), unless VLLM_LOGGING_LEVEL says otherwise. vLLM sets
    its loggers' level from that variable as it is imported, and warns on some imports before
    that, through the parent logger's level. The workers, which start later, log at vLLM's own
    level into the run's workers.log."""
    if "VLLM_LOGGING_LEVEL" in os.environ:
        yield
        return
    parent = logging.getLogger("vllm")
    level = parent.level
    os.environ["VLLM_LOGGING_LEVEL"] = "ERROR"
    parent.setLevel(logging.ERROR)
    try:
        yield
    finally:
        del os.environ["VLLM_LOGGING_LEVEL"]
        parent.setLevel(level)


def run(cfg: Config, argv: list[str]) -> None:
    """Train; a run that stops early says why in one line, with the command that resumes it
    (``argv``: the command line of this job), and exits non-zero. Ray is shut down either way.
    The output directory is locked first: a second run there stops with exit 2, touching
    nothing (``runs.locked``). The run's definition is recorded there next, and its end."""
    from rlhf_paro import runs
    from rlhf_paro.compose import load_config

    with runs.locked(cfg.trainer.output_dir):
        # As composed again, now that ``prepare`` made the demo's assets: their paths, not the
        # ``${demo:NAME}`` of a first run, define it, as they do every later run's.
        runs.record_definition(load_config(argv))
        _run(cfg, argv)
        runs.mark_finished(cfg.trainer.output_dir, cfg.trainer.steps)


def _run(cfg: Config, argv: list[str]) -> None:
    import ray

    from rlhf_paro.actors.group import (
        NoAnswerError, RayOutput, RayStartError, StopRequested, WorkerError,
    )
    from rlhf_paro.trainer import PPOTrainer, RunError, StopFlag

    trainer = None
    stopped = None
    stop = StopFlag()
    # Ray's and the workers' console output, kept in the output directory (README, "Logs").
    output = RayOutput(os.path.join(cfg.trainer.output_dir, WORKERS_LOG))

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        # Raising here could land inside Ray's own code: the trainer stops at its next safe
        # point (the step's end, or within a second while the workers start).
        stop.requested = True

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    # Ctrl-C in the run is a KeyboardInterrupt, which the trainer turns into a RunError.
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        trainer = PPOTrainer(cfg, stop, output)
        dashboard = trainer.fit()
    except (WorkerError, NoAnswerError) as err:  # while the workers start, before any step
        stopped = RunError(f"{err} while starting", "auto")
    except RayStartError as err:
        stopped = RunError(str(err), "auto")
    except KeyboardInterrupt:
        stopped = RunError("interrupted while starting", "auto", exit_code=130)
    except StopRequested:
        stopped = RunError("terminated (SIGTERM) while starting", "auto", exit_code=143)
    except SystemExit as err:
        if err.code != signal.SIGTERM:
            raise
        # SIGTERM while ray.init had its own handler in place (actors/group.py, init_ray).
        stopped = RunError("terminated (SIGTERM) while starting", "auto", exit_code=143)
    except RunError as err:
        stopped = err
    finally:
        # The shutdown below is the safe point a second SIGTERM would cut short.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if trainer is not None:
            trainer.shutdown()
        # No process of the run outlives it; the next job of a multirun starts its own Ray,
        # sized for its own devices.
        ray.shutdown()
        output.close()
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)
    if stopped is not None:
        print(f"error: {stopped}; resume with: {resume_command(argv, stopped.resume)}",
              file=sys.stderr)
        raise SystemExit(stopped.exit_code)
    print(f"metrics: {cfg.trainer.output_dir}/metrics.jsonl\ndashboard: {dashboard}")


# In the output directory: what Ray and the workers print (actors/group.py, RayOutput).
WORKERS_LOG = "workers.log"


def with_ray_address(cfg: Config, environ: Mapping[str, str]) -> Config:
    """``cfg`` with ``ray.address`` set to RAY_ADDRESS where the conf leaves it null, as
    ``ray.init`` reads it: a driver started for a cluster (a Ray job, or a command of
    ``scripts/emulate_cluster.py --ray``) joins that cluster."""
    if cfg.ray.address or not environ.get("RAY_ADDRESS"):
        return cfg
    return dataclasses.replace(cfg, ray=dataclasses.replace(cfg.ray,
                                                            address=environ["RAY_ADDRESS"]))


def resume_command(argv: list[str], resume: str) -> str:
    """The command line ``argv`` again, going on from a checkpoint (``trainer.resume``), its
    path quoted where the override parser would not read it back as typed (a comma in it)."""
    from rlhf_paro.compose import parse_overrides, quoted

    kept = [arg for arg in argv if not arg.startswith("trainer.resume=")]
    typed = f"trainer.resume={resume}"
    try:
        as_typed = parse_overrides([typed])[1][0].value == resume
    except ConfigError:
        as_typed = False
    typed = typed if as_typed else f"trainer.resume={quoted(resume)}"
    return shlex.join(["python", "-m", "rlhf_paro.train", *kept, typed])


def require_ray(address: str) -> None:
    """Fail in seconds, before the slow imports, when no Ray cluster answers at ``address``."""
    from rlhf_paro.actors.group import check_address

    try:
        check_address(address)
    except ConnectionError as err:
        raise ConfigError("ray.address", f"{err}; {RAY_ADDRESS_ALLOWED}") from None


def require_gpus(cfg: Config, conf: str) -> None:
    """Fail at once, before any work, when a GPU conf does not find its GPUs."""
    if cfg.cluster.device != "cuda":
        return
    import ray
    import torch

    from rlhf_paro.actors.group import init_ray

    need = cfg.cluster.num_devices
    shape = f"{need} CUDA GPUs ({cfg.cluster.num_groups} groups x {cfg.cluster.group_size})"
    advice = ("; run the CPU demo with `python -m rlhf_paro.train` (conf=ppo_tiny) or size this "
              f"conf with `python -m rlhf_paro.plan conf={conf}`")
    if not cfg.ray.address:
        have = torch.cuda.device_count()
        if have < need:
            raise ConfigError("cluster.device", f"conf {conf} needs {shape} and this machine "
                                                f"has {have}{advice}")
        return
    try:
        init_ray(cfg.ray.address, None, need)
    except ConnectionError:
        raise ConfigError("ray.address", f"conf {conf} needs {shape} on a Ray cluster and none "
                          f"runs at {cfg.ray.address!r} (start one with `ray start --head` and "
                          f"`ray start --address=HEAD:6379` on the other nodes){advice}") from None
    have = int(ray.cluster_resources().get("GPU", 0))
    if have < need:
        raise ConfigError("cluster.device", f"conf {conf} needs {shape} and the Ray cluster at "
                                            f"{cfg.ray.address!r} has {have}{advice}")


if __name__ == "__main__":
    cli.exit_when_done(main)
