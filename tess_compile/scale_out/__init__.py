"""Past one [q, q, d] mesh, wrapping the runtime: data parallelism in one process and the
batch checks of scale-out (`data_parallel`), and pipeline stages (`pipeline`,
`stage_ports`, `simulated_pipeline`)."""
