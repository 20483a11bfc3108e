from rlhf_paro.actors import _engine_standin  # noqa: F401  TEMP: until the engine checkpoints itself
