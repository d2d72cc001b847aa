"""Reading compiled programs, never on the compile path: bytes and FLOPs (`accounting`),
bytes as formulas (`symbolic`), the cluster and the cost model (`cluster`, `cost_model`,
`memory`), its calibration (`calibration`), measuring this machine (`profiling`), the
planner (`planner`, `parallel_plan`), the choice of a schedule for "auto" options
(`schedule_choice`) and graph dumps (`graph_dump`, `graph_views`)."""
