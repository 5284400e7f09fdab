"""The CPU path's C kernels, built with the system C compiler on first use and called through
ctypes; where one cannot be built (no compiler, BATCHLLM_CPU_KERNEL=0) its torch twin in
batchllm_kernels.reference runs instead.

  decode.c / decode.py    decode attention over the pages in place
  prefill.c / prefill.py  prefill-chunk attention, and a shared prefix merged into it in place
  ops.c / ops.py          RMSNorm with residual add, rotary embedding, SiLU-and-multiply, KV store
  linear.c / linear.py    the projections, on weights laid out once in 16-column panels
  simd.h                  e^x and the online softmax, 8 lanes at a time (shared by the .c files)
  build.py                compile, cache and load a kernel (the cache key includes the header)
  checks.py               the argument check the attention bindings share
  attention.py            a step's paged attention: C or torch per part (decodes, chunks)

Needs no triton.
"""
