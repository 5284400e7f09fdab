"""scripts/bench.py's parts, one role each: the workload, the transformers baselines, the batchllm
run, the settings run in this process, a fresh process per setting, and the table."""
