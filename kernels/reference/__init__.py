"""Pure-torch twins of the kernels, one per file as in kernels/triton/: the CPU path of the
engine (where a C kernel does not serve) and the references the kernels are tested against.

  store_kv.py          a step's new K and V into their slots of the paged cache
  paged_attention.py   causal attention of a step over paged KV (decodes and prefill chunks)
  prefix_attention.py  each group's queries against its shared prefix pages
  merge_states.py      two attention states merged by the log-sum-exp rule
  attend.py            the dense products the two attention twins share
  step_index.py        which cache rows each sequence of a step reads, built once per step
  pointwise.py         RMSNorm with residual add, rotary embedding, SiLU-and-multiply

Needs torch only (no triton, no C compiler).
"""
