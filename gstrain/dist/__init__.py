"""Multi-process training pieces (issue 16): the record exchange, partitions, the comm model
and the sharded renderer. Built on torch.distributed (gloo on CPU, NCCL on GPUs)."""
