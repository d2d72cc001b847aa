"""Reading compiled programs: bytes and FLOPs (`accounting`), bytes as formulas (`symbolic`, with
the local shapes of `symbolic_shapes`), the cost model (`cost_model`, `memory`, the kernels it
prices `kernels`, the fake step that records a step's memory, kernels and saved bytes at once
`step_record`; the `Cluster` it prices on is `tess_compile.core.cluster`; the user's loop
around a call, `step_tail`), its calibration
(`calibration`), a program compiled with block reuse priced from its shorter forms
(`block_reuse`), measuring this machine (`profiling`, timing every rank at once with
`rank_timing`) and how far off the predictions are there (`profile_check`), the planner
(`planner`, its search `plan_search`, `candidate_meshes`, `parallel_plan`, ZeRO-3 priced per FSDP2 unit
`zero_units`, its table `plan_table`, its chart `plan_plot`) and the decode planner (`decode_plan`, with
what laying the weights out for serving costs, `layout_conversion`), the choice of a schedule for "auto" options
(`schedule_choice`) and graph dumps (`graph_dump`, `graph_views`). The faces' compile entry
(`compile_entry`) lives here too, because it prices the "auto" candidates before it calls the
compiler: the compiler itself (`tess_compile.passes`) never imports an analysis."""
