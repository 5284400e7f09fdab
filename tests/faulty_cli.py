"""batchllm's command line with one fault injected, for tests of what a failing run says and
leaves behind (BATCHLLM_TEST_FAULT):

  enospc:N  every fsync of a written file after the first N fails with ENOSPC, as a full disk
            fails a delayed write (the file is then half written under its temporary name)
  crash     the run raises RuntimeError once the engine has started (an unexpected failure)
"""

from __future__ import annotations

import errno
import os
import stat
import sys


def _enospc_after(n: int) -> None:
    real = os.fsync
    count = 0

    def fsync(fd: int) -> None:
        nonlocal count
        if stat.S_ISREG(os.fstat(fd).st_mode):
            count += 1
            if count > n:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd)

    os.fsync = fsync


def _crash() -> None:
    from batchllm.engine.engine import Engine

    def generate(self, *args, **kwargs):
        raise RuntimeError("injected failure inside the engine")

    Engine.generate = generate


if __name__ == "__main__":
    fault = os.environ.get("BATCHLLM_TEST_FAULT", "")
    if fault.startswith("enospc:"):
        _enospc_after(int(fault.split(":")[1]))
    elif fault == "crash":
        _crash()
    from batchllm.cli import main

    sys.argv[0] = "batchllm"
    main()
