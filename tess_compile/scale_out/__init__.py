"""Past one [q, q, d] mesh, wrapping the runtime: data parallelism in one process and the
batch checks of scale-out (`data_parallel`), pipeline stages (`pipeline`, `stage_ports`,
`simulated_pipeline`), ZeRO-3 with one FSDP2 unit per repeated block (`block_units`), and what one rank runs of a whole parallel spec, dp x pp x [q, q, d]
(`rank_run`: `parallelize`)."""
