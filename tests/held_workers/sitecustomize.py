"""Imported at the start of every Python process whose path holds this folder (test_scale_ops's
SIGTERM test puts it on the PYTHONPATH of `batchllm run`, which its Ray workers inherit). With
BATCHLLM_TEST_HOLD set to a folder, a checkpoint writer that has flushed a part and holds one
more finished row writes a flag file there and waits, in the worker's run thread, to be stopped:
the worker is held with a finished row not yet in a part, whatever its pace, while its other
thread still answers the driver (flush)."""

import os

if os.environ.get("BATCHLLM_TEST_HOLD"):
    import time

    from batchllm.rows.writer import CheckpointWriter

    _add = CheckpointWriter.add

    def _add_then_hold(self, row) -> None:
        _add(self, row)
        if self.tag and self.rows_flushed and len(self._rows) == 1:  # a worker's writer
            flag = os.path.join(os.environ["BATCHLLM_TEST_HOLD"], f"held{self.tag}-{os.getpid()}")
            open(flag, "w").close()
            while True:
                time.sleep(60)

    CheckpointWriter.add = _add_then_hold
