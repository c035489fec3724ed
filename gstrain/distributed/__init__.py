"""Multi-process training (issue 16): the record exchange, partitions, the comm model, the sharded
renderer, and the trainer that `torchrun -m gstrain fit` runs (trainer.py, launch.py, checkpoint.py).
Built on torch.distributed (gloo on CPU, NCCL on GPUs)."""
