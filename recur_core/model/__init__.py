"""The looped model and its on-disk formats: config, LoopedLM, the training recipe, checkpoints (native, Huginn-0125)."""
