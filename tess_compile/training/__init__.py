"""Training with torch's own tools around a sharded module: gradient clipping (`clip`),
loading weights shard by shard from checkpoints (`shard_loading`), and a whole training step
as one call (`train_step`; captured in CUDA graphs by `step_graphs`)."""
