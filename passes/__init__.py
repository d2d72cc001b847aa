"""The compiler, `tess_compile.passes`: a model's graph in, one SPMD per-rank graph out, one pass a file.

    capture (writes through views made functional) -> boundary -> (causal convs) -> (recompute blocks)
    -> place -> verify -> rewrite -> merge products -> alike regions
    -> (recompute selective) -> bucket gradients -> verify -> report repeated work

`tess_compile.passes.driver.compile_model` calls the passes in that order and
packs the result in a `Program` (`tess_compile.core.program`). The passes, one
file each: `capture` (with `view_mutations`, `data_dependent`,
`checkpoint_regions`, `model_errors`, `causal_masks` (a causal mask built from sizes alone
given to attention as `is_causal`), `meta_device` for a model on the meta device,
`capture_reuse`, one export shared by several compiles, and `dynamic_capture`, the
symbolic dims of a dynamic capture), `token_order` (the stripes a captured graph's token split takes),
`repeated_blocks` (a model's alike
layers found and the graph shortened to four of them) and `expand_blocks` (block 2's per-rank
nodes copied for the blocks it stands for), `boundary`, `autocast_casts`, `causal_convs` (over a
token split, a causal conv and its slice as one node), `recompute_blocks`, `place`, `verify`,
`rewrite` (emitting through `builder`, converting layouts
by `redistribute`, products by `summa` in a schedule priced by
`product_schedule`), `merge_products`, `alike_regions`, `recompute_selective`,
`bucket_gradients` and `repeated_work`; what they share: the observers of a
compile (`observers`), the model's own source lines in messages
(`source_lines`) and the bounds of a dynamic program's sizes (`size_limits`). The passes hand
each other their results in `meta`, through the keys of `tess_compile.core.meta_keys`. The op
families' rules are in `passes/rules/`, one file a family. The compiler builds
on tess_compile's core (mesh, layouts, options, programs) and ops (what a
per-rank graph calls), and on nothing else of it. Its folder is `passes/` at
the top of the repository, installed as `tess_compile.passes` (pyproject.toml's
package-dir).
"""

from tess_compile.core.program import Program
from tess_compile.passes.driver import compile_model, mode_compiler

__all__ = ["Program", "compile_model", "mode_compiler"]
