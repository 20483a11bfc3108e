"""Before stopping: has the engine lost ground to DeepSpeed and FSDP2? Ratios against a baseline.

    python scripts/check_peers.py                  # exit 1 if a pair got worse beyond its band
    python scripts/check_peers.py --metrics cpu    # a busy machine: only CPU ratios decide
    python scripts/check_peers.py --record         # a new baseline, after a change that is meant
    python scripts/check_peers.py --record --repeats 5 -- --contenders zero2,zero3 --rounds 4

It runs ``scripts/bench_peers.py`` with the arguments the baseline was recorded with (and any
given after ``--``, which come last and so win) and compares each pair's ratio ours / peer, of
the wall time and of the CPU time per step, with the baseline's (``scripts/peers_baseline.json``).
Ratios, not absolute times: both sides of a pair run on the same machine in the same rounds, so a
faster or slower machine moves both alike. A pair whose ratio is above the baseline's by more
than its noise band got worse (exit 1); one below it by more than the band got better (exit 0,
and the baseline is due for --record). On a machine busy with other work wall ratios move by
more than a quiet machine's band: ``--metrics cpu`` decides on CPU time, which a rank loses no
more of while other work holds the cores (but which does not see waiting: a slower collective
shows only in wall time).

``--record`` runs the benchmark ``--repeats`` times and keeps per pair and measure the median of
the repeats' ratios and a noise band, the spread of the repeats (largest less smallest), at least
``--min-band``: a repeat lies within that distance of the median by construction, and a later run
of the same code beyond it is farther out than any of the repeats. The file also keeps how it was
made: the command, the benchmark's arguments, the date, the load average before and after, the
revision and the releases of torch, transformers and deepspeed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, NamedTuple, Sequence

HERE = Path(__file__).resolve().parent
BASELINE = HERE / "peers_baseline.json"
METRICS = ("wall", "cpu")  # the ratios of bench_peers' pairs: wall time, CPU time per step
# What --record runs unless the arguments after -- say otherwise: bench_peers' 7 pairs, 3 rounds.
BENCH_DEFAULTS = ["--rounds", "3", "--steps", "3", "--warmup", "1"]


class Finding(NamedTuple):
    pair: str
    metric: str
    baseline: float | None  # None: the baseline has no such pair
    band: float | None
    measured: float | None  # None: not measured this time
    verdict: str  # worse, better, within, no baseline, not measured


def bench_arguments(given: list[str]) -> list[str]:
    """What --record runs: BENCH_DEFAULTS but those ``given`` sets itself, then ``given``."""
    flags = {item.split("=", 1)[0] for item in given}
    defaults = [item for flag, value in zip(BENCH_DEFAULTS[::2], BENCH_DEFAULTS[1::2])
                if flag not in flags for item in (flag, value)]
    return [*defaults, *given]


def noise_band(ratios: Sequence[float], min_band: float) -> tuple[float, float]:
    """The median of repeated runs' ratios and the band around it: their spread (largest less
    smallest), at least ``min_band``, so that a few repeats that agree by chance do not make a
    band that ordinary noise leaves."""
    return statistics.median(ratios), max(min_band, max(ratios) - min(ratios))


def record(runs: Sequence[dict[str, dict[str, float]]], min_band: float
           ) -> dict[str, dict[str, dict[str, Any]]]:
    """Per pair and measure of the repeated ``runs`` (pair -> measure -> ratio): the baseline
    ratio, its band and the repeats' ratios. Only pairs every run measured."""
    pairs = [p for p in runs[0] if all(p in run for run in runs)]
    baseline: dict[str, dict[str, dict[str, Any]]] = {}
    for pair in pairs:
        baseline[pair] = {}
        for metric in METRICS:
            ratios = [run[pair][metric] for run in runs]
            ratio, band = noise_band(ratios, min_band)
            baseline[pair][metric] = dict(ratio=ratio, band=band, runs=ratios)
    return baseline


def compare(baseline: dict[str, dict[str, dict[str, Any]]],
            measured: dict[str, dict[str, float]], metrics: Sequence[str]) -> list[Finding]:
    """Each pair and measure of ``metrics`` against the baseline: worse when the ratio is above
    the baseline's by more than the band, better when below it by more, within otherwise."""
    findings = []
    for pair in list(baseline) + [p for p in measured if p not in baseline]:
        for metric in metrics:
            base = baseline.get(pair, {}).get(metric)
            now = measured.get(pair, {}).get(metric)
            if base is None:
                findings.append(Finding(pair, metric, None, None, now, "no baseline"))
                continue
            ratio, band = base["ratio"], base["band"]
            if now is None:
                verdict = "not measured"
            elif now > ratio + band:
                verdict = "worse"
            elif now < ratio - band:
                verdict = "better"
            else:
                verdict = "within"
            findings.append(Finding(pair, metric, ratio, band, now, verdict))
    return findings


def got_worse(findings: Sequence[Finding]) -> list[Finding]:
    """The findings that fail the check."""
    return [f for f in findings if f.verdict == "worse"]


def report(findings: Sequence[Finding]) -> str:
    def number(x: float | None, form: str) -> str:
        return "-" if x is None else format(x, form)

    head = (f"{'pair':16} {'measure':7} {'baseline':>8} {'band':>6} {'now':>6} {'change':>7}  "
            f"verdict")
    lines = [head, "-" * len(head)]
    for f in findings:
        change = None if f.baseline is None or f.measured is None else f.measured - f.baseline
        lines.append(f"{f.pair:16} {f.metric:7} {number(f.baseline, '8.3f'):>8} "
                     f"{number(f.band, '6.3f'):>6} {number(f.measured, '6.3f'):>6} "
                     f"{number(change, '+7.3f'):>7}  {f.verdict}")
    return "\n".join(lines)


def run_bench(arguments: list[str]) -> tuple[dict[str, dict[str, float]], dict[str, Any]]:
    """bench_peers.py with ``arguments`` (its tables go to the console): per pair its wall and
    CPU ratios, and the releases it ran on."""
    with tempfile.TemporaryDirectory(prefix="check_peers_") as tmp:
        out = Path(tmp) / "bench.json"
        done = subprocess.run([sys.executable, str(HERE / "bench_peers.py"), *arguments,
                               "--json", str(out)])
        if done.returncode or not out.exists():
            raise SystemExit(f"error: bench_peers.py {shlex.join(arguments)} failed "
                             f"(exit {done.returncode})")
        document = json.loads(out.read_text())
    ratios = {row["name"]: {metric: row[metric] for metric in METRICS}
              for row in document["pairs"]}
    return ratios, document["jobs"][0]["versions"]


def _revision() -> str:
    """The checked-out commit, ``+changes`` when the tree differs from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(HERE), *args], capture_output=True,
                              text=True).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, default=BASELINE, help="the baseline file")
    parser.add_argument("--record", action="store_true",
                        help="measure --repeats times and write the baseline")
    parser.add_argument("--repeats", type=int, default=3, help="runs that --record measures")
    parser.add_argument("--min-band", type=float, default=0.05,
                        help="--record: the narrowest band a ratio gets")
    parser.add_argument("--metrics", default=",".join(METRICS),
                        help=f"comma-separated measures that decide: {', '.join(METRICS)}")
    parser.add_argument("bench", nargs="*", help="bench_peers.py arguments (after --)")
    args = parser.parse_args(argv)
    metrics = [m for m in args.metrics.split(",") if m]
    if not metrics or any(m not in METRICS for m in metrics):
        parser.error(f"--metrics {args.metrics!r}: allowed: {', '.join(METRICS)}, "
                     f"comma-separated")
    if args.repeats < 1 or args.min_band < 0:
        parser.error("--repeats must be at least 1 and --min-band at least 0")
    command = "python scripts/check_peers.py " + shlex.join(sys.argv[1:] if argv is None
                                                            else argv)

    if args.record:
        arguments = bench_arguments(args.bench)
        before = _load()
        runs, versions = [], {}
        for repeat in range(args.repeats):
            print(f"repeat {repeat + 1}/{args.repeats}: bench_peers.py {shlex.join(arguments)}",
                  file=sys.stderr, flush=True)
            ratios, versions = run_bench(arguments)
            runs.append(ratios)
        baseline = record(runs, args.min_band)
        provenance = dict(
            command=command, bench_arguments=arguments,
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            load_average=dict(before=before, after=_load(), cpus=os.cpu_count()),
            revision=_revision(), versions=versions, repeats=args.repeats,
            band="the repeats' largest ratio less their smallest, at least "
                 f"{args.min_band:g}, around their median")
        args.baseline.write_text(json.dumps(dict(provenance=provenance, pairs=baseline),
                                            indent=1) + "\n")
        print(report(compare(baseline, runs[-1], METRICS)))
        print(f"baseline of {len(baseline)} pairs written to {args.baseline}")
        return 0

    if not args.baseline.exists():
        print(f"error: no baseline at {args.baseline}; record one with --record",
              file=sys.stderr)
        return 2
    stored = json.loads(args.baseline.read_text())
    provenance = stored["provenance"]
    before = _load()
    measured, _ = run_bench([*provenance["bench_arguments"], *args.bench])
    findings = compare(stored["pairs"], measured, metrics)
    print(report(findings))
    print(f"load average {before} before, {_load()} after ({os.cpu_count()} cores); the "
          f"baseline: {provenance['load_average']['before']} before, "
          f"{provenance['load_average']['after']} after, {provenance['date']}, "
          f"{provenance['revision']}")
    worse = got_worse(findings)
    moved = [f for f in findings if f.verdict in ("worse", "better")]
    if moved:
        print("moved beyond the band: " + ", ".join(f"{f.pair} {f.metric} {f.verdict}"
                                                    for f in moved))
    if not worse and any(f.verdict == "better" for f in findings):
        print("better than the baseline: record a new one (--record) to keep the gain")
    return 1 if worse else 0


if __name__ == "__main__":
    sys.exit(main())
