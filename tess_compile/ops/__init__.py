"""What a per-rank graph calls besides torch's kernels: the collectives and their
communicators (`collectives`), the memory-lean product of fetched blocks
(`fetched_product`), attention over tokens split across ranks (`context_attention`:
keys and values gathered; `ring_attention`: passed in a ring; their kernels in
`attention_kernels`), the norm over a split dim (`split_norm`), gradient buckets
(`grad_bucket`), recompute regions (`recompute_region`), dropout's masks drawn
as the unsharded model draws them (`dropout`) and rank-local targets (`local`).
The compiler emits calls to them; the runtimes run them. One target lives in the
placed graph alone: the causal conv1d (`causal_conv`), which the rewrite lowers to torch's conv."""
