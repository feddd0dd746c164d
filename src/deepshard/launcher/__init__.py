"""The ``deepshard`` launcher: DeepSpeed's command line and hostfile, each node's ranks under torch's elastic agent
(:mod:`.agent`), the nodes meeting in torch's c10d rendezvous (:mod:`.rendezvous`), and the fan-out over ssh, pdsh,
``--no_ssh``, MPI and Slurm (:mod:`.multinode`)."""
