"""The typed errors every stage raises.

One module so that the engine, the notebooks and the HTTP server agree on what went wrong:
the server maps each class to an HTTP status (``http_status``) and an OpenAI-style error
``type``; a person reading a traceback gets a message that names the problem and the fix.
"""

from __future__ import annotations


class LifeOfPromptError(Exception):
    """Base class: catch this to catch every error the project raises on purpose."""

    http_status = 500
    error_type = "internal_error"


class ModelNotFoundError(LifeOfPromptError):
    """A model name or path that we cannot load (never answered by silently using random weights)."""

    http_status = 404
    error_type = "model_not_found"


class MissingDependencyError(LifeOfPromptError):
    """A package the requested feature needs is not installed; the message says how to install it."""

    http_status = 500
    error_type = "missing_dependency"


class StructuredOutputUnavailableError(MissingDependencyError):
    """Structured output (or a tool call) was asked for, but its grammar library (xgrammar) cannot be
    imported here, e.g. on a Python it has no wheel for. The request, not the server, asks for
    what is missing, so the server answers 400 and the message names the package and the install command."""

    http_status = 400

    def __init__(self, message: str, *, param: str | None = "structured_outputs"):
        super().__init__(message)
        self.param = param


class InvalidRequestError(LifeOfPromptError, ValueError):
    """A request (or argument) that can never be served as given: bad sampling values, empty ids, …"""

    http_status = 400
    error_type = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None, index: int | None = None):
        if index is not None:
            message = f"request {index}: {message}"
        super().__init__(message)
        self.param = param
        self.index = index


class RequestTooLargeError(InvalidRequestError):
    """A request longer than the model's context, or larger than the whole KV pool could ever hold."""

    http_status = 413
    error_type = "request_too_large"


class ConfigError(LifeOfPromptError, ValueError):
    """An engine or memory setting that is out of range (block_size <= 0, utilization outside (0, 1], …);
    ``param`` names the setting."""

    http_status = 400
    error_type = "invalid_config"

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.param = param


class OutOfMemoryError(LifeOfPromptError):
    """The model does not fit the device at all, or the KV pool would have no block left."""

    http_status = 507
    error_type = "insufficient_memory"


class QueueFullError(LifeOfPromptError):
    """The engine's waiting queue is full: retry later (the server answers 503)."""

    http_status = 503
    error_type = "server_overloaded"


class ShuttingDownError(LifeOfPromptError):
    """The server is draining after SIGTERM: no new requests (HTTP 503, with Retry-After)."""

    http_status = 503
    error_type = "server_shutting_down"


class AuthenticationError(LifeOfPromptError):
    """A missing or wrong API key (HTTP 401, as OpenAI answers it)."""

    http_status = 401
    error_type = "invalid_request_error"
    code = "invalid_api_key"


class RequestFailedError(LifeOfPromptError):
    """One request failed inside a step (its sampler row, its detokenizer): it alone ends, the step goes on."""

    http_status = 500
    error_type = "internal_error"


class RequestNotFoundError(LifeOfPromptError, KeyError):
    """An abort or lookup named a request id the engine does not know."""

    http_status = 404
    error_type = "request_not_found"

    def __str__(self) -> str:  # KeyError would otherwise print the message quoted
        return str(self.args[0]) if self.args else ""


class SpeculativeConfigError(ConfigError):
    """A bad ``speculative_config``: message and ``param`` name the field (``method``, …)."""

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(f"speculative_config[{param!r}]: {message}" if param else message)
        self.param = param


class ParallelConfigError(ConfigError):
    """A tensor- or pipeline-parallel size the model's shapes cannot be split by; names the valid ones."""

    def __init__(self, message: str, *, valid_sizes: tuple[int, ...] = ()):
        super().__init__(message)
        self.valid_sizes = tuple(valid_sizes)


class WorkerFailedError(LifeOfPromptError):
    """A parallel worker process died or stopped answering; the engine has shut the others down.

    The engine cannot serve any more (its model is split over the workers): build a new one.
    """

    http_status = 503
    error_type = "engine_unavailable"

    def __init__(self, message: str, *, rank: int | None = None, exitcode: int | None = None):
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode
