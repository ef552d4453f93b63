"""The exceptions outbox-notify raises: one root, a few precise subclasses."""

from __future__ import annotations


class OutboxNotifyError(Exception):
    """Root of every error outbox-notify raises on purpose."""


class ConfigurationError(OutboxNotifyError):
    """A setting or flag has a value the library cannot work with."""


class SerializationError(OutboxNotifyError, TypeError):
    """Task arguments or options cannot be stored as JSON in the outbox."""


class DatabaseUnavailable(OutboxNotifyError):
    """PostgreSQL cannot be reached, or the connection broke mid-operation."""


class BrokerUnavailable(OutboxNotifyError):
    """The broker cannot be reached: an outage that should not spend a message's retries."""


class PublishError(OutboxNotifyError):
    """One message could not be published while the broker itself was reachable."""


class UndecodableMessage(OutboxNotifyError):
    """A stored row cannot be turned into a broker message (bad options, unknown version)."""


class GaugeUnavailable(OutboxNotifyError):
    """A metrics gauge could not be read while the database connection stayed usable."""


class OnceKeyError(OutboxNotifyError, ValueError):
    """A OnceTask key (or scope) cannot be stored: not a str, empty, too long, or has a NUL."""


class MarkedForRollback(OutboxNotifyError):
    """A OnceTask body or an event handler returned, but its transaction could only roll back.

    It caught a database error (which leaves the transaction aborted or marked for rollback)
    or called `transaction.set_rollback(True)`: nothing it did, its inbox key included, was
    committed, so the delivery must not count as done.
    """
