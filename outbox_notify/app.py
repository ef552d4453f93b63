"""OutboxCelery: the write side, which stores tasks in the outbox instead of publishing them."""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import celery
from celery import signals as celery_signals
from celery.result import AsyncResult
from django.core import checks as django_checks
from kombu.utils.objects import cached_property

from outbox_notify import _chord_calls as chord_calls
from outbox_notify import compact, held, observability, serialization, transport
from outbox_notify._write import batching, context, instrumentation, message_templates, results
from outbox_notify._write import settings as write_settings
from outbox_notify._write.rows import insert_row
from outbox_notify.exceptions import ConfigurationError

# Producer and connection arguments name a broker path we do not take.
_BROKER_ARGS = ("producer", "connection", "publisher")
# Keys of a Celery event that the dispatcher fills in when it publishes; the relay's
# dispatcher fills them in again when the task is really sent.
_EVENT_ENVELOPE = frozenset({"type", "hostname", "utcoffset", "pid", "clock", "timestamp"})
SENT_EVENT_ROUTING_KEY = "task.sent"

# Every OutboxCelery alive in this process, for the start-up check of their configuration.
instances: weakref.WeakSet[OutboxCelery] = weakref.WeakSet()

# A worker would log outbox_notify's info events as WARNING lines (observability.py says why).
celery_signals.celeryd_after_setup.connect(
    observability.route_worker_logs, weak=False, dispatch_uid="outbox_notify.route_worker_logs"
)


class _NoConnection:
    """The `producer.connection` Celery's send_task touches; nothing here talks to a broker."""

    # Celery wraps a worker's callback publishes in a retry loop keyed on these.
    connection_errors: tuple[type[BaseException], ...] = ()
    channel_errors: tuple[type[BaseException], ...] = ()
    recoverable_connection_errors: tuple[type[BaseException], ...] = ()
    recoverable_channel_errors: tuple[type[BaseException], ...] = ()

    @contextlib.contextmanager
    def _reraise_as_library_errors(self) -> Iterator[None]:
        yield


class RecordingProducer:
    """Stands in for a kombu Producer inside Celery's send_task and records the publish."""

    serializer = None  # what Celery's eager path asks of a producer

    def __init__(self) -> None:
        self.connection = _NoConnection()
        self.recorded: tuple[Any, dict[str, Any]] | None = None
        self.sent_event: dict[str, Any] | None = None

    def revive(self, channel: Any) -> None:
        """Nothing to revive: there is no channel."""

    def publish(self, body: Any, **kwargs: Any) -> None:
        """Keep the task message; keep the fields of a `task-sent` event published after it."""
        if self.recorded is None:
            self.recorded = (body, kwargs)
        elif kwargs.get("routing_key") == SENT_EVENT_ROUTING_KEY and isinstance(body, dict):
            self.sent_event = {k: v for k, v in body.items() if k not in _EVENT_ENVELOPE}


class OutboxCelery(celery.Celery):
    """A Celery app whose send_task writes to the outbox table in the caller's transaction."""

    # revoke() removes a task still waiting in the outbox before Celery's broadcast.
    control_cls = "outbox_notify.held:OutboxControl"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        instances.add(self)
        # Registered here, not in ready(): ready() never runs when the app is not installed.
        django_checks.register(check_app_installed)

    def _get_backend(self) -> Any:
        backend = super()._get_backend()  # type: ignore[misc]
        on_task_call = backend.on_task_call

        def skip_while_recording(producer: Any, task_id: str) -> Any:
            # Result backends (Redis) subscribe to the result when a task is sent. At enqueue
            # nothing may touch the network; AsyncResult.get() subscribes when it waits.
            if isinstance(producer, RecordingProducer | batching.GroupProducer):
                return None
            return on_task_call(producer, task_id)

        backend.on_task_call = skip_while_recording
        # Celery subscribes to results as it sends a group or builds a group's result: those
        # subscriptions are kept until something waits (results.py).
        results.defer(backend, collector=batching.active, replaying=chord_calls.replaying)
        # A chord's size (and a header of groups) goes to the backend from the relay, just
        # before the header's tasks are published (_chord_calls.py).
        chord_calls.wrap(backend, recording=lambda: batching.active() is not None)
        return backend

    @cached_property
    def GroupResult(self) -> Any:
        """Celery's group result class for this app; its barrier's subscriptions are kept until
        something waits (results.py)."""
        return self.subclass_with_self(results.GroupResult)

    def producer_or_acquire(self, producer: Any = None) -> Any:
        """Canvas fan-out (group, chunks, chords' headers) collects its rows and writes them once.

        Celery's group publishes all its members inside one `producer_or_acquire()` block;
        here that block is a bulk collection, so a group of N tasks is one INSERT. A group
        sent inside that block (its members hand it their GroupProducer) is a nested fan-out,
        whose rows join the outer one's (batching.for_group).
        """
        if self.conf.task_always_eager or not (
            producer is None or isinstance(producer, batching.GroupProducer)
        ):
            return super().producer_or_acquire(producer)
        return batching.for_group(self)

    # Celery's keyword arguments all pass through **options to Celery's own send_task.
    @transport.explained
    def send_task(  # type: ignore[override]
        self, name: str, args: Any = None, kwargs: Any = None, **options: Any
    ) -> AsyncResult[Any]:
        settings = write_settings.current()
        if name in settings.exclude_tasks:
            return self._send_past_outbox(name, args, kwargs, options)
        wrapper = instrumentation.send_task_wrapper()
        if wrapper is instrumentation.UNKNOWN or not self.plain_super_send_task():
            # Something wraps Celery's send_task that the template path cannot stand in for.
            made = self.record(name, args, kwargs, options, settings, send=super().send_task)
        elif wrapper is None:
            made = _build_call(self, name, args, kwargs, options, settings=settings)
        else:
            assert not isinstance(wrapper, instrumentation.Unknown)
            made = _wrapped_build(wrapper)(self, name, args, kwargs, **options)
        collector = batching.active()
        if collector is not None and collector.alias == settings.alias:
            collector.add(made.row)
        else:
            insert_row(made.row, settings.alias, self)
        result: AsyncResult[Any] = made.result
        return result

    def _send_past_outbox(
        self, name: str, args: Any, kwargs: Any, options: dict[str, Any]
    ) -> AsyncResult[Any]:
        """Celery's own send_task for a task in OUTBOX_NOTIFY_EXCLUDE_TASKS: published now."""
        for key in ("producer", "publisher"):
            if isinstance(options.get(key), batching.GroupProducer):
                del options[key]
        if any(options.get(key) is not None for key in _BROKER_ARGS):
            return super().send_task(name, args, kwargs, **options)
        # Given no producer, Celery's send_task asks self.producer_or_acquire() for one, and
        # ours hands out the group collector, which cannot publish: take one from the pool.
        for key in _BROKER_ARGS:
            options.pop(key, None)
        with super().producer_or_acquire() as producer:
            return super().send_task(name, args, kwargs, producer=producer, **options)

    def plain_super_send_task(self) -> bool:
        """Whether the send_task this app's super() reaches is celery.Celery's own."""
        klass: Any = type(self)
        return _plain_super(klass)

    def record(
        self,
        name: str,
        args: Any,
        kwargs: Any,
        options: dict[str, Any],
        settings: write_settings.WriteSettings,
        *,
        send: Any = None,
    ) -> message_templates.Made:
        """Let Celery build the message against a recording producer; return it as a row.

        `send` is the send_task that builds it (Celery's own, unwrapped, by default).
        """
        relative = serialization.relative_times(options)
        for key in ("countdown", "expires"):
            if key in options:
                options[key] = serialization.seconds(options[key])
        for key in _BROKER_ARGS:
            options.pop(key, None)
        recorder = RecordingProducer()
        if send is None:
            send = functools.partial(instrumentation.original_send_task(), self)
        result = send(name, args, kwargs, producer=recorder, **options)
        if recorder.recorded is None:
            raise ConfigurationError(f"Celery did not produce a message for task {name!r}")
        return message_templates.Made(
            result=result, row=self.row_from(recorder, relative, settings)
        )

    def row_from(
        self,
        recorder: RecordingProducer,
        relative: dict[str, float],
        settings: write_settings.WriteSettings,
    ) -> serialization.OutboxRow:
        """The validated outbox row for what a RecordingProducer recorded."""
        assert recorder.recorded is not None
        body, publish_kwargs = recorder.recorded
        row = compact.build_row(
            body,
            publish_kwargs,
            app=self,
            relative=relative,
            context=context.capture(
                settings.structlog_keys,
                sentry=not context.carries_sentry_trace(publish_kwargs.get("headers")),
            ),
            sent_event=recorder.sent_event,
            hold_until=held.hold_until(
                publish_kwargs.get("headers") or {}, settings.hold_eta_after
            ),
        )
        serialization.validate_row(row)
        return row


def _build(
    app: OutboxCelery, name: str, args: Any, kwargs: Any, **options: Any
) -> message_templates.Made:
    """The message and row of one call: from its shape's template, or Celery's full path.

    Called as Celery's send_task would be (positional app, name, args, kwargs), so a tracing
    wrapper of Celery's send_task can be applied around it (see instrumentation.py).
    """
    return _build_call(app, name, args, kwargs, options, settings=write_settings.current())


def _build_call(
    app: OutboxCelery,
    name: str,
    args: Any,
    kwargs: Any,
    options: dict[str, Any],
    *,
    settings: write_settings.WriteSettings,
) -> message_templates.Made:
    call = message_templates.Call(app=app, name=name, args=args, kwargs=kwargs, options=options)
    return message_templates.enqueue(call, settings)


_wrapped_builds: dict[Any, Any] = {}


def _wrapped_build(wrapper: instrumentation.Wrapper) -> Any:
    """_build inside `wrapper` (made once per wrapper factory)."""
    wrapped = _wrapped_builds.get(wrapper)
    if wrapped is None:
        wrapped = _wrapped_builds[wrapper] = wrapper(_build)
    return wrapped


def check_task_protocol(app_configs: Any = None, **kwargs: Any) -> list[Any]:
    """System check outbox_notify.E010: every OutboxCelery app uses task protocol 2.

    Protocol 1 messages cannot be stored (the relay rebuilds protocol 2 bodies); without this
    check each enqueue would fail with the same ConfigurationError.
    """
    from django.core import checks

    from outbox_notify import conf

    apps = set(instances)
    with contextlib.suppress(ConfigurationError):
        if conf.celery_app_path():
            configured = conf.celery_app()
            if isinstance(configured, OutboxCelery):
                apps.add(configured)
    return [
        checks.Error(
            f"Celery app {app.main!r} has task_protocol={app.conf.task_protocol}: "
            + serialization.PROTOCOL_1_MESSAGE,
            id="outbox_notify.E010",
            obj=app.main,
        )
        for app in sorted(apps, key=lambda a: str(a.main))
        if app.conf.task_protocol != 2
    ]


@functools.cache
def _plain_super(klass: Any) -> bool:
    mro = klass.__mro__
    after = mro[mro.index(OutboxCelery) + 1 :]
    owner = next((klass for klass in after if "send_task" in vars(klass)), None)
    return owner is celery.Celery


def check_app_installed(
    app_configs: Sequence[Any] | None = None, **kwargs: Any
) -> list[django_checks.CheckMessage]:
    """E008 when an OutboxCelery exists but outbox_notify is not an installed Django app.

    Registered by OutboxCelery itself: without the app, ready() never registers anything.
    """
    from django.apps import apps

    names = sorted(str(app.main) for app in instances)
    if not names or apps.is_installed("outbox_notify"):
        return []
    return [
        django_checks.Error(
            f"'outbox_notify' is missing, but OutboxCelery {', '.join(map(repr, names))} writes "
            "tasks to the outbox: no migration creates the outbox tables and the relay commands "
            "do not exist",
            hint="add 'outbox_notify' to INSTALLED_APPS, then run: python manage.py migrate",
            obj="INSTALLED_APPS",
            id="outbox_notify.E008",
        )
    ]
