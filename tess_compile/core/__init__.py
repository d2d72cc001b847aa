"""The core every other layer builds on: the mesh and its rank arithmetic (`mesh`), layouts
and blocks (`layout`), the machine a cost is for (`cluster`), the collectives of a per-rank
graph, one record each (`collective_table`), the compile options (`options`), a compiled
`Program` (`program`), the keys the passes leave in `meta` (`meta_keys`), dynamic shapes
(`dynamic`) and fake runs of a per-rank graph (`fake_run`). It imports nothing else of
tess_compile."""
