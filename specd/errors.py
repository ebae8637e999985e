"""Typed errors of the core. Services map them to transport statuses in one place each
(gRPC interceptor, HTTP exception handler); the CLI prints them as one line."""


class SpecdError(Exception):
    """Base class of every error specd raises on purpose."""


class InvalidRequest(SpecdError):
    """A parameter is wrong. `field` names it so that callers can point at it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class ModelError(SpecdError):
    """A model cannot be loaded or a draft/target pair does not fit together."""


class Overloaded(SpecdError):
    """The service is at capacity; try again later."""


class Unavailable(SpecdError):
    """A service this request needs is not reachable."""


class Idle(SpecdError):
    """A client kept a session open and sent nothing for longer than it may."""
