"""The core every other layer builds on: the mesh and its rank arithmetic (`mesh`), layouts
and blocks (`layout`), the machine a cost is for (`cluster`), the collectives of a per-rank
graph, one record each (`collective_table`), with their lowerings to torch's functional
collectives (`functional_lowerings`) and their calls on a process group, made once
(`group_calls`), the matrix products, one record each (`product_table`),
the compile options (`options`), how a batch and its tokens split into rows (`row_split`),
the FLOP counter (`flops`), a whole parallel layout, dp x pp x [q, q, d]
(`parallel_spec`), a compiled `Program` (`program`), the keys the passes leave
in `meta` (`meta_keys`), torch.autocast's state (`autocast`), dynamic shapes (`dynamic`) and
fake runs of a per-rank graph (`fake_run`). It imports nothing else of tess_compile."""
