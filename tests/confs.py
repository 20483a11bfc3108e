"""Command-line keys for tests that want the default run with inline (random) models and the
task's own prompts instead of the demo's files (``ppo/demo.py``)."""

# The demo's architecture (conf/ppo_tiny.yaml, task.model) as an inline config.
TINY_MODEL = ("{model_type: llama, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, "
              "num_attention_heads: 4, num_key_value_heads: 4, max_position_embeddings: 64}")
# actor.config drops the conf's actor.path, data.train_files=null its val_files and score; the
# reward, critic and ref then inherit the actor's inline config.
INLINE = [f"actor.config={TINY_MODEL}", "reward.path=null", "data.train_files=null",
          "data.max_prompt_length=8"]


def load(argv, engine_check=True):
    """The config an entry point runs for the command line ``argv``: composed, then resolved
    (the demo's assets made, files checked, derived values set); ``engine_check=False`` as the
    planner resolves it, without the rollout engine's own check."""
    from rlhf_paro.compose import load_config
    from rlhf_paro.resolve import resolve

    return resolve(load_config(argv), engine_check=engine_check)
