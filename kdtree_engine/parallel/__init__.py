"""Tensor + expert parallelism over ``torch.distributed`` (docs/parallel.md): the communicator and the cross-rank
sums (comm.py), the layout and the sharded loading (shard.py), the vocabulary split (vocab.py), expert
parallelism (experts.py), joining a group (group.py), rank 0's requests to the other ranks (broadcast.py) and launching
workers (launch.py)."""
