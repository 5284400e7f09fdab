"""The error of a job that cannot start because of its job file, an override or its input."""

from __future__ import annotations


class ConfigError(Exception):
    """The job cannot start: the job file, an override or the input is invalid (exit code 2).

    `errors` holds one message per problem; str(error) joins them with newlines.
    """

    def __init__(self, *errors: str) -> None:
        self.errors = list(errors)
        super().__init__("\n".join(errors))
