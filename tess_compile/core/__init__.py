"""The core every other layer builds on: the mesh and its rank arithmetic (`mesh`), layouts
and blocks (`layout`), the machine a cost is for (`cluster`), the compile options
(`options`), a compiled `Program` (`program`), and fake runs of a per-rank graph
(`fake_run`). It imports nothing else of tess_compile."""
