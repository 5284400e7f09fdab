"""Scale-out: one job over many workers. `assign` (which input rows each worker runs) needs no
Ray; `driver` and `worker` run the shards on Ray actors and import ray only when a job uses it."""
