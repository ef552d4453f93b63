"""OnceTask: a Celery task whose body commits at most once per key (effectively once).

The body runs inside `transaction.atomic()` on the outbox database, after inserting its key
into the inbox table (`outbox_notify_inbox_v1`) in that same transaction. So the key is
committed exactly when the body's effects are:

- the body returns: key and effects commit together; every later delivery of the key finds it
  and is skipped (acknowledged, `Ignore`d, logged and signalled);
- the body raises (a retry included): key and effects roll back together; the next delivery
  runs the body again;
- two deliveries at once: the second one's insert waits for the first one's transaction on the
  unique key, then skips (committed) or runs (rolled back). Never both.

See docs/once.md for what this covers and what it does not.
"""

from __future__ import annotations

import contextvars
import dataclasses
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn

import celery
import structlog
from celery.exceptions import Ignore, Retry
from celery.utils.time import get_exponential_backoff_interval
from django.db import connections, transaction

from outbox_notify import conf, inbox, observability, signals

if TYPE_CHECKING:
    from celery.result import AsyncResult

    TaskBase = celery.Task[Any, Any]
else:  # celery-types makes Task generic; at run time it need not be subscriptable
    TaskBase = celery.Task

log = structlog.get_logger("outbox_notify")

# Tasks that stay plain even when OnceTask is the app's default class: Celery's own (chord
# unlocking, result cleanup: their effects live in the result backend) and ours (the purges
# delete in many short transactions, which one body transaction would fold into one).
PLAIN_TASK_PREFIXES = ("celery.", "outbox_notify.")

# The id of the task whose body runs inside its once-transaction in this context (thread or
# greenlet): a retry() there must wait until that transaction has rolled back.
_RUNNING: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "outbox_notify_once_running", default=None
)


class _RetryAfterRollback(Retry):
    """What retry() raises inside a body: unwinds the transaction, then OnceTask retries.

    A Retry subclass, so Celery's autoretry wrapper and user code that re-raises Retry let it
    through. It never leaves OnceTask.__call__.
    """

    def __init__(self, options: dict[str, Any]) -> None:
        super().__init__("retry once the body's transaction has rolled back", options.get("exc"))
        self.options = options


@dataclasses.dataclass(slots=True)
class _Attempt:
    """What one delivery's transaction ended with, for what OnceTask does after it."""

    body_raised: bool = False
    retry: dict[str, Any] | None = None
    conflict: inbox.KeyConflict | None = None


class OnceTask(TaskBase):
    """Base class for tasks whose effects in the outbox database must happen once per key.

    `@app.task(base=OnceTask)`, or `OutboxCelery("proj", task_cls=OnceTask)` for every task.
    Attributes (settable as decorator options):

    - `once_key`: None (the key is the task id), or a callable given the task's arguments
      exactly as the body gets them, returning a str of 1-255 characters without NUL. As a
      decorator option it receives only the arguments; as a method of a subclass, self first.
    - `once_scope`: the namespace of the keys; None means the task's name. Tasks that set the
      same scope share their keys.
    - `once`: False makes the task a plain one (for a task_cls default with exceptions).

    .. versionadded:: 0.1.0
    """

    once: ClassVar[bool] = True
    once_key: ClassVar[Callable[..., str] | None] = None
    once_scope: ClassVar[str | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        key = cls.__dict__.get("once_key")
        # Celery turns decorator options into class attributes of the class it makes (marked
        # `_decorated`): a function given there takes the task's arguments, not self.
        if cls.__dict__.get("_decorated") and inspect.isfunction(key):
            cls.once_key = staticmethod(key)

    def once_applies(self) -> bool:
        """Whether deliveries go through the inbox: not for Celery's and outbox-notify's tasks."""
        return bool(self.once) and not str(self.name).startswith(PLAIN_TASK_PREFIXES)

    def once_inbox_key(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], task_id: str | None
    ) -> inbox.OnceKey:
        """The scope and key a delivery with these arguments records; OnceKeyError if unfit."""
        scope = self.name if self.once_scope is None else self.once_scope
        scope = inbox.checked_key(scope, "the once scope")
        if self.once_key is None:
            return inbox.OnceKey(
                scope=scope, key=inbox.checked_key(task_id, "the task id"), derived=False
            )
        key = inbox.checked_key(self.once_key(*args, **kwargs), f"once_key of {self.name}")
        return inbox.OnceKey(scope=scope, key=key, derived=True)

    def apply_async(
        self, args: Any = None, kwargs: Any = None, *more: Any, **options: Any
    ) -> AsyncResult[Any]:
        # A key that cannot be stored fails here, in the caller's transaction, not later in
        # a worker.
        if self.once_key is not None and self.once_applies():
            self.once_inbox_key(tuple(args or ()), dict(kwargs or {}), None)
        return super().apply_async(args, kwargs, *more, **options)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        # Called as a plain function (no message, no delivery): nothing to deduplicate.
        if request.called_directly or not self.once_applies():
            return super().__call__(*args, **kwargs)
        key = self.once_inbox_key(args, kwargs, request.id)
        return self._deliver(key, str(request.id), args, kwargs)

    def retry(  # noqa: PLR0917 - Celery's own retry() signature, mirrored
        self,
        args: tuple[Any, ...] | None = None,
        kwargs: dict[str, Any] | None = None,
        exc: Exception | None = None,
        throw: bool = True,
        eta: Any = None,
        countdown: float | None = None,
        max_retries: int | None = None,
        **options: Any,
    ) -> Retry:
        """Celery's retry; inside the body it first rolls the body's transaction back."""
        request_id = self.request.id
        if throw and request_id is not None and _RUNNING.get() == request_id:
            # The retry message goes through the outbox: written now, in the transaction
            # that is about to roll back, it would be lost with it.
            raise _RetryAfterRollback(
                dict(
                    args=args,
                    kwargs=kwargs,
                    exc=exc,
                    eta=eta,
                    countdown=countdown,
                    max_retries=max_retries,
                    **options,
                )
            )
        return super().retry(args, kwargs, exc, throw, eta, countdown, max_retries, **options)

    def _deliver(
        self, key: inbox.OnceKey, task_id: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Record the key and run the body in one transaction, or skip, or retry."""
        alias = conf.database_alias()
        connection = connections[alias]
        attempt = _Attempt()
        try:
            with transaction.atomic(using=alias):
                if inbox.record(connection, key, task_id=task_id, task_name=self.name):
                    value = self._run_body(attempt, task_id, args, kwargs)
                    inbox.require_commit(connection, f"the body of {self.name}")
                    return value
        except _RetryAfterRollback as deferred:
            attempt.retry = deferred.options
        except inbox.KeyConflict as exc:
            attempt.conflict = exc
        except Exception as exc:
            # The body's own exceptions went through Celery's autoretry already; these come
            # from the key insert or the commit, which Celery's wrapper of run() never sees.
            if attempt.body_raised or not self._autoretries(exc):
                raise
            attempt.retry = {"exc": exc, **self._autoretry_options()}
        # Outside the except clauses, so nothing raised from here on chains onto them.
        if attempt.retry is not None:
            self._retry_after_rollback(alias, attempt.retry)
        self._skip(alias, key, task_id, attempt.conflict)

    def _run_body(
        self, attempt: _Attempt, task_id: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        token = _RUNNING.set(task_id)
        try:
            # What Celery's tracer calls for a task without a custom __call__; its request is
            # already pushed.
            return self.run(*args, **kwargs)
        except BaseException:
            attempt.body_raised = True
            raise
        finally:
            _RUNNING.reset(token)

    def _autoretries(self, exc: Exception) -> bool:
        """Whether the task's autoretry_for (minus dont_autoretry_for) covers `exc`."""
        retry_on = tuple(getattr(self, "autoretry_for", ()) or ())
        never = tuple(getattr(self, "dont_autoretry_for", ()) or ())
        return bool(retry_on) and isinstance(exc, retry_on) and not isinstance(exc, never)

    def _autoretry_options(self) -> dict[str, Any]:
        """retry() arguments as Celery's autoretry computes them (retry_kwargs, backoff)."""
        options = dict(getattr(self, "retry_kwargs", None) or {})
        backoff = float(getattr(self, "retry_backoff", False) or 0)
        if backoff:
            options["countdown"] = get_exponential_backoff_interval(
                factor=int(max(1.0, backoff)),
                retries=self.request.retries,
                maximum=int(getattr(self, "retry_backoff_max", 600)),
                full_jitter=bool(getattr(self, "retry_jitter", True)),
            )
        return options

    def _retry_after_rollback(self, alias: str, options: dict[str, Any]) -> NoReturn:
        """Send the retry (through the outbox, in a transaction of its own), then raise it."""
        with transaction.atomic(using=alias):
            retry = super().retry(throw=False, **options)
        raise retry

    def _skip(
        self, alias: str, key: inbox.OnceKey, task_id: str, conflict: inbox.KeyConflict | None
    ) -> NoReturn:
        """Report a duplicate delivery and acknowledge it without running the body."""
        first = inbox.owner(connections[alias], key)
        if conflict is not None and first is None:
            # The serialization failure was not about a committed key: a real error.
            raise conflict.__cause__ or conflict
        log.info(
            "outbox.duplicate_skipped",
            task_id=task_id,
            task_name=self.name,
            scope=key.scope,
            key_from="once_key" if key.derived else "task_id",
            first_task_id=first,
        )
        observability.send_signal(
            signals.outbox_duplicate_skipped,
            task_id=task_id,
            task_name=self.name,
            scope=key.scope,
            key=key.key,
            first_task_id=first,
        )
        raise Ignore()
