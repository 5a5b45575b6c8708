"""What runs in the engine's processes during training: the rollout loop (``engine_process``),
its episode driver and group scorer, and the scoring processes that run the environments off
the engine's thread. Nothing here runs in the trainer's process."""
