"""Why a model cannot be used. The command line turns these into exit code 2 (cannot start)."""

from __future__ import annotations


class ModelError(Exception):
    """The model cannot be used as asked: missing, incomplete, unsupported, or too small for the
    settings. The message names the job field (model.path, model.device, ...) and what to do."""


class ModelNotFoundError(ModelError):
    """The model path is neither a built-in alias nor a usable local Hugging Face folder."""
