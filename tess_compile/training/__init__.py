"""Training with torch's own tools around a sharded module: gradient clipping (`clip`)
and loading weights shard by shard from checkpoints (`shard_loading`)."""
