"""A LoRA actor's weight sync to a rollout replica: the whole model merged at every sync
(``actor.lora.sync=merged``) against the base weights once and the adapters alone after
(``actor.lora.sync=adapters``), side by side.

    python scripts/bench_lora_sync.py                       # 8 x 1024 Llama (103M), hf and vllm
    python scripts/bench_lora_sync.py --engines hf --steps 3

GRPO (``conf=grpo_tiny``: 16 prompts x 4 samples a step, the counting task's prompts and score)
with a random Llama made from its config (--layers x --hidden, fp32; nothing is downloaded),
adapters of rank --rank on q, k, v and o, on one training device with a replica of its own one
step off (``rollout.num_devices=1 rollout.max_staleness=1``), --steps steps, for each engine of
--engines: the merged job, then the adapters job, each its own ``python -m rlhf_paro.train``.

Per job: the model's parameters, the bytes the actor sent with the first sync (the base weights
under ``actor/comm/base_transfer``, for the adapters job), the median over the steps after the
first of the bytes a step sent (``actor/comm/transfer``) and of the seconds of a sync, on the
actor (``actor/time_s/sync``: gathering and sending) and on the replica (``rollout/time_s/sync``:
receiving and loading into the engine), and the median step. The last step is left out: one step
off, the run launches no rollout beyond its end, so no sync.

Overrides after ``--`` go to every job.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="hf,vllm", help="rollout.engine values, in turn")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16, help="attention heads (head size 64)")
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--rank", type=int, default=8, help="actor.lora.r")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=8, help="ppo.max_new_tokens")
    parser.add_argument("overrides", nargs="*", help="after --: overrides of every job")
    return parser.parse_args(argv)


def run_job(overrides: list[str], output_dir: Path) -> list[dict]:
    """One training job; its metrics rows (its own errors end the benchmark)."""
    command = [sys.executable, "-m", "rlhf_paro.train", *overrides,
               f"trainer.output_dir={output_dir}", "logger.wandb.mode=disabled",
               "logger.progress=false", "trainer.save_every=0", "trainer.export_every=0"]
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        raise SystemExit(f"error: {' '.join(overrides)} failed:\n{done.stderr[-2000:]}")
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def summary(rows: list[dict]) -> dict[str, float]:
    """The first sync's base bytes; medians over the steps after the first but the last (the
    replica's sync: over the rows after the first that report one)."""
    kept = rows[1:-1]

    def median(key: str) -> float:
        return statistics.median(r.get(key, 0.0) for r in kept)

    return {"base MB": rows[0].get("actor/comm/base_transfer/intra_bytes", 0) / 1e6,
            "MB/step": median("actor/comm/transfer/intra_bytes") / 1e6,
            "actor sync s": median("actor/time_s/sync"),
            # The replica reports a sync with the generation after it: the rows that received.
            "replica sync s": statistics.median(r["rollout/time_s/sync"] for r in rows[1:]
                                                if r.get("rollout/sync/received_bytes", 0) > 0),
            "step s": median("timing_s/step")}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    model = (f"{{model_type: llama, hidden_size: {args.hidden}, intermediate_size: "
             f"{args.intermediate}, num_hidden_layers: {args.layers}, num_attention_heads: "
             f"{args.heads}, num_key_value_heads: {args.heads}, max_position_embeddings: 128}}")
    # The demo's tokenizer and prompts (its SFT model's folder holds the tokenizer).
    shared = ["conf=grpo_tiny", f"actor.config={model}", "actor.tokenizer=${demo:actor}",
              "cluster.num_devices=1", "cluster.group_size=1", "rollout.num_devices=1",
              "rollout.max_staleness=1", "trainer.eval_every=0", f"trainer.steps={args.steps}",
              f"ppo.max_new_tokens={args.new_tokens}", "actor.lora.enabled=true",
              f"actor.lora.r={args.rank}",
              "actor.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]", *args.overrides]
    params = (args.layers * (4 * args.hidden ** 2 + 3 * args.hidden * args.intermediate)) / 1e6
    lines = [f"a {args.layers} x {args.hidden} Llama: {params:.1f}M parameters in its blocks; "
             f"adapters of rank {args.rank} on q, k, v, o"]
    head = f"{'engine':<8}{'sync':<10}" + "".join(f"{c:>16}" for c in (
        "base MB", "MB/step", "actor sync s", "replica sync s", "step s"))
    lines.append(head)
    with tempfile.TemporaryDirectory(prefix="bench_lora_sync_") as tmp:
        for engine in args.engines.split(","):
            for sync in ("merged", "adapters"):
                rows = run_job([*shared, f"rollout.engine={engine}", f"actor.lora.sync={sync}"],
                               Path(tmp) / f"{engine}-{sync}")
                s = summary(rows)
                lines.append(f"{engine:<8}{sync:<10}" + "".join(f"{v:>16.3f}" for v in s.values()))
                print(lines[-1], flush=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
