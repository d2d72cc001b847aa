"""Reading compiled programs, never on the compile path: bytes and FLOPs (`accounting`),
bytes as formulas (`symbolic`), the cost model (`cost_model`, `memory`; the `Cluster` it
prices on is `tess_compile.core.cluster`), its calibration (`calibration`), measuring this
machine (`profiling`, timing every rank at once with `rank_timing`) and how far off the
predictions are there (`profile_check`), the planner (`planner`, `candidate_meshes`,
`parallel_plan`), the choice of a schedule for "auto" options (`schedule_choice`) and graph
dumps (`graph_dump`, `graph_views`)."""
