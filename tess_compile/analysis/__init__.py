"""Reading compiled programs, never on the compile path: bytes and FLOPs (`accounting`),
bytes as formulas (`symbolic`), the cluster and the cost model (`cluster`, `cost_model`,
`memory`), its calibration (`calibration`), the planner (`planner`, `parallel_plan`) and
graph dumps (`graph_dump`, `graph_views`)."""
