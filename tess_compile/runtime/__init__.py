"""Running compiled programs: one rank on torch.distributed (`sharded_module`, over the
groups of `groups` and the communicator of `dist_comm`; parameters and outputs as DTensors,
`dtensors`; their gradients as views into flat buffers for a whole step, `grad_buffers`;
every rank's weights and inputs checked alike, `consistency`), every rank in
this process (`simulator`; compiled programs in threads, `threaded`), programs through
inductor (`inductor`, their collectives lowered to torch's functional collectives by
`functional_collectives`), one program per train/eval mode (`programs_by_mode`), the local
shards (`state`), ZeRO by FSDP2 (`zero`), and local multi-process runs (`launch`)."""
