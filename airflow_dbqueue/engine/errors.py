"""One exception family for the engine: everything it raises derives from :class:`DbQueueError`.

Driver exceptions are translated at the dialect boundary, so callers never need to import a database
driver to handle a queue failure.
"""

from __future__ import annotations

from collections.abc import Sequence


class DbQueueError(Exception):
    """Base class of every error the engine raises."""


class InvalidNameError(DbQueueError, ValueError):
    """A queue or schema name is not a valid identifier."""


class ConfigurationError(DbQueueError, ValueError):
    """An argument or setting is out of range or inconsistent."""


class ConflictingArgumentsError(ConfigurationError, TypeError):
    """A call named one argument twice: by its deprecated name and by its new one."""


class QueueNotFoundError(DbQueueError, LookupError):
    """The named queue does not exist in the schema."""

    def __init__(self, queue: str, schema: str) -> None:
        super().__init__(f"queue {queue!r} does not exist in schema {schema!r}; create it first")
        self.queue = queue
        self.schema = schema


class QueueExistsError(DbQueueError):
    """A queue of that name exists with settings that differ from the requested ones."""


class SchemaError(DbQueueError):
    """The queue schema is missing, or newer than this version of the code understands."""


class ForeignObjectsError(SchemaError):
    """The schema holds (or the engine's objects are used by) database objects the engine did not
    create; the call changed nothing. ``objects`` describes each of them."""

    def __init__(self, message: str, objects: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.objects = list(objects)


class PayloadError(DbQueueError, ValueError):
    """A payload cannot be pushed; nothing of the batch it belonged to was written."""


class PayloadTypeError(PayloadError, TypeError):
    """A payload's Python type does not match the queue's payload type."""


class PayloadTooLargeError(PayloadError):
    """A payload is larger than the queue's ``max_payload_bytes``."""


class LeaseExpiredError(DbQueueError):
    """An ack or nack named messages whose lease has expired (or that were never leased).

    The whole call was rolled back: no message of the call was acknowledged.
    """

    def __init__(self, queue: str, ids: Sequence[int]) -> None:
        shown = ", ".join(str(i) for i in list(ids)[:10]) + (" ..." if len(ids) > 10 else "")
        super().__init__(
            f"queue {queue!r}: lease expired or not held for {len(ids)} message(s) [{shown}]; "
            "they will be (or were) delivered again; nothing in this call was acknowledged"
        )
        self.queue = queue
        self.ids = list(ids)


class ReceiptsNotHeldError(DbQueueError):
    """The database refused a statement because some of its receipts no longer hold their lease.

    Raised by a dialect whose ack checks this inside the statement (PostgreSQL); the statement changed
    nothing. The queue turns it into a :class:`LeaseExpiredError` that names the messages.
    """


class BatchNotFoundError(DbQueueError, LookupError):
    """No batch with this id was claimed from this queue."""

    def __init__(self, queue: str, batch_id: str) -> None:
        super().__init__(f"queue {queue!r}: no batch {batch_id!r} was claimed from it")
        self.queue = queue
        self.batch_id = batch_id


class BatchStateError(DbQueueError):
    """A batch was asked to do what its state forbids (ack a released batch, extend a finished one)."""


class QueueFullError(DbQueueError):
    """A bounded queue (ring) stayed full for longer than the push timeout; nothing was pushed."""


class RingNumbersSkippedError(DbQueueError):
    """Consumers gave a ring push's numbers up as gaps before it wrote them; nothing was pushed.

    The ring retries such a push with new numbers itself; callers see this only if that keeps failing.
    """


class GroupNotFoundError(DbQueueError, LookupError):
    """A ring has no consumer group of that name."""

    def __init__(self, queue: str, group: str) -> None:
        super().__init__(f"queue {queue!r} has no consumer group {group!r}")
        self.queue = queue
        self.group = group


class GroupExistsError(DbQueueError):
    """A ring has a consumer group of that name already."""


class NotSupportedError(DbQueueError, NotImplementedError):
    """The database (its dialect) does not offer this feature; the message says what does."""


class TransactionRequiredError(DbQueueError):
    """Exactly-once pop was asked for without a caller's transaction to run in."""


class DatabaseUnavailableError(DbQueueError, ConnectionError):
    """The database could not be reached, or the connection broke during the call."""


class PermissionDeniedError(DbQueueError, PermissionError):
    """The connection's role may not do this (``DbQueue.grant`` says who may): nothing was changed.
    ``queue`` and ``action`` name what was refused, where the engine knows them."""

    def __init__(self, message: str, *, queue: str | None = None, action: str | None = None) -> None:
        super().__init__(message)
        self.queue = queue
        self.action = action


class LoginError(DbQueueError):
    """The server (or the pooler in front of it) refused the connection for a reason that waiting does
    not mend: the database or the role does not exist, the password is wrong, or no ``pg_hba.conf``
    entry lets the role in. Raised at once, not retried until the connect timeout."""


class DatabaseError(DbQueueError):
    """Any other database failure, translated from the driver's exception."""


class TransientDatabaseError(DatabaseError):
    """The database rolled the transaction back for a reason that may pass (deadlock, lock timeout).

    The engine runs its own statements again a few times; inside the caller's transaction it raises
    this, and the caller may run its whole transaction again.
    """


class DeadlockError(TransientDatabaseError):
    """The transaction was chosen as a deadlock victim and rolled back."""


class LockTimeoutError(TransientDatabaseError):
    """A lock was not granted within the session's lock timeout."""


class StatementTimeoutError(TransientDatabaseError):
    """A statement was cancelled before it finished: it ran past its statement timeout (the driver's
    query timeout on SQL Server), or, on PostgreSQL, an administrator cancelled it
    (``pg_cancel_backend``). Its transaction was rolled back."""
