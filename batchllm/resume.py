"""output.mode, and what a run must match to resume: the job's fingerprint (rows/fingerprint.py)
with this run's numerics, resolved before the model loads.

  error      an existing output or checkpoint stops the job (exit 2)
  overwrite  the checkpoint is removed; the run starts from nothing
  resume     the rows in the checkpoint's parts are kept, the others run; parts of another job
             are moved aside, parts with other numerics refuse the resume (exit 2). A final
             file with no checkpoint is complete only when it holds this job's fingerprint
             (the Parquet file's metadata; for the OpenAI Batch JSONL, its metrics file):
             otherwise the resume is refused (exit 2), never reported complete.
"""

from __future__ import annotations

import json
import sys

from batchllm.config import JobConfig
from batchllm.rows import storage
from batchllm.rows.fingerprint import (
    canonical,
    differences,
    fingerprint,
    identity,
    loads,
    model_files,
    numerics_changed,
)
from batchllm.rows.redact import redact
from batchllm.rows.writer import FINGERPRINT_KEY, CheckpointWriter

OVERWRITE_HINT = "use output.mode: overwrite (--set output.mode=overwrite) to start again"


class JobCannotStart(Exception):
    """The job cannot start: the output exists or another run writes it, an input or the model
    is missing (exit code 2)."""


def numerics(cfg: JobConfig) -> dict:
    """What the numbers of this run's rows depend on, known before the weights load: the model
    folder's files, the dtype and device resolved as the load will (auto: bfloat16 on CUDA,
    float32 on the CPU), the kernel path, the weight and KV formats. A job of several workers
    resolves `auto` on this machine; each worker checks that it runs the same device and dtype
    (scale/worker.py)."""
    import torch

    from batchllm.model.loader import pick_device, pick_dtype
    from batchllm.model.ops import kernel_path
    from batchllm.model.resolve import resolve_model

    folder = resolve_model(cfg.model.path, cfg.model.revision)
    if cfg.engine.workers > 1 and cfg.model.device != "auto":  # the workers' device, not ours
        device = torch.device(cfg.model.device)
    else:
        device = pick_device(cfg.model.device)
    dtype = str(pick_dtype(cfg.model.dtype, device)).removeprefix("torch.")
    return {"model": model_files(folder), "dtype": dtype, "device": device.type,
            "kernel_path": kernel_path(device.type, dtype),
            "quantization": cfg.model.quantization, "kv_cache_dtype": cfg.engine.kv_cache_dtype}


def job_fingerprint(cfg: JobConfig, files: tuple[str, ...]) -> dict:
    """The fingerprint this run writes into its parts and final file."""
    return fingerprint(cfg, files, numerics(cfg))


def final_fingerprint(cfg: JobConfig) -> dict:
    """The fingerprint an existing final file was written with ({} when it holds none)."""
    path = cfg.output.path
    try:
        if cfg.output.format == "parquet":
            import pyarrow.parquet as pq

            meta = pq.read_schema(storage.arrow_source(path)).metadata or {}
            return loads(meta.get(FINGERPRINT_KEY))
        with storage.open_bytes(path + ".metrics.json") as f:
            stored = json.load(f).get("fingerprint")
        return stored if isinstance(stored, dict) else {}
    except (OSError, ValueError, AttributeError):  # unreadable, not Parquet, not JSON
        return {}


def prepare_output(cfg: JobConfig, writer: CheckpointWriter) -> set | None:
    """Apply output.mode; returns the rows already done, or None when the output is complete
    (resume of this job's final file). Raises JobCannotStart or ConfigError (exit 2)."""
    out = cfg.output.path
    if storage.is_dir(out):  # no mode replaces a folder: found before the model runs
        raise JobCannotStart(f"output.path: {out} is a folder; give the path of the file to "
                             "write")
    exists = storage.exists(out)
    if cfg.output.mode == "error" and (exists or writer.has_checkpoint()):
        what = out if exists else writer.parts_dir
        raise JobCannotStart(f"output.path: {what} exists; set output.mode to overwrite or "
                             "resume (--set output.mode=resume)")
    if cfg.output.mode == "overwrite":
        writer.clear()
        return set()
    if cfg.output.mode != "resume":
        return set()
    if exists and not writer.has_checkpoint():
        theirs, ours = final_fingerprint(cfg), writer.fingerprint
        if canonical(theirs) == canonical(ours):
            return None
        if not theirs:
            why = "holds no fingerprint of a batchllm job"
        elif canonical(identity(theirs)) != canonical(identity(ours)):
            why = f"is another job's output (differs in: {', '.join(differences(theirs, ours))})"
        else:
            raise JobCannotStart(numerics_changed(out, theirs, ours).replace(
                "output.mode: ", "output.path: ", 1))
        raise JobCannotStart(f"output.path: {out} exists and {why}; nothing of it can be "
                             f"resumed: {OVERWRITE_HINT}")
    done = writer.done_rows()
    for bad in writer.discarded:
        print(redact(f"batchllm: warning: {bad.path} {bad.why}; moved to "
                             f"{bad.moved_to}; its rows run again"), file=sys.stderr)
    return done
