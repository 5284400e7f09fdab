"""batchllm's kernels, sorted by kind:

  kernels/triton/     the Triton kernels of the CUDA path, one per file, each behind a launcher
                      that checks its inputs (needs triton; nothing else imports it)
  kernels/cpu/        the CPU path's C kernels (sources, header), their builder and ctypes
                      bindings, and the CPU attention dispatcher (C or torch per part of a step)
  kernels/reference/  the pure-torch twins of both (store, paged and prefix attention, merge,
                      pointwise steps) and the step index they use

Which of them a model runs is picked once per (device, dtype) in batchllm/model/ops.py.
"""
