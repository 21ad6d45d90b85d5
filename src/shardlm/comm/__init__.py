"""Transport: how tensors move between ranks. `collectives` holds the process-group calls (NCCL on GPUs,
gloo on CPUs), `copy_engine` the peer-to-peer copies over symmetric memory on one node's GPUs, and
`transport` the two bucket transports the data-parallel engines are written against."""
