"""Read-only admin for the outbox and the dead letters, with a few guarded actions.

Rows are never added, edited or deleted through forms: the relay owns them. Object pages are
read-only for everyone; the model's change permission only grants the actions ("reset
retries" and "cancel" on outbox rows, "requeue" on dead letters), and each action leaves a
LogEntry.
Arguments are shown through `outbox_notify.redaction`, never raw.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db import connections
from django.db.models import Model, Q, QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils import timezone

from outbox_notify import compact, conf, dashboard, deadletter, held, redaction, stats
from outbox_notify.exceptions import ConfigurationError
from outbox_notify.models import DeadLetter, InboxRecord, OutboxDashboard, OutboxMessage
from outbox_notify.serialization import EVENT_VERSION

if TYPE_CHECKING:
    ModelAdmin = admin.ModelAdmin[Any]
else:  # django-stubs makes ModelAdmin generic; at run time it is not subscriptable
    ModelAdmin = admin.ModelAdmin

FILTER_SAMPLE = 10_000  # rows read to offer task names in the filter (no full-table DISTINCT)
TEXT_PREVIEW = 80  # characters of last_error / failure_reason in the list
MAX_RETRIES_CHOICE = 5  # the retries filter groups this many and more


class TaskNameFilter(admin.SimpleListFilter):
    """Filter by task name, offering the names seen in a bounded sample of rows.

    A DISTINCT over the whole table would read millions of rows on every page load. Any
    name can still be filtered on with `?task_name=NAME` in the URL.
    """

    title = "task name"
    parameter_name = "task_name"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        names = set(model_admin.task_name_sample(request))
        if self.value():
            names.add(str(self.value()))
        return [(name, name) for name in sorted(names)]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if self.value():
            return queryset.filter(task_name=self.value())
        return queryset


class RetriesFilter(admin.SimpleListFilter):
    """Filter by retries spent: 0, 1, ... and 'MAX_RETRIES_CHOICE or more'."""

    title = "retries"
    parameter_name = "retries"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        choices = [(str(n), str(n)) for n in range(MAX_RETRIES_CHOICE)]
        return [*choices, (f"{MAX_RETRIES_CHOICE}+", f"{MAX_RETRIES_CHOICE} or more")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if value is None:
            return queryset
        if value.endswith("+") and value[:-1].isdigit():
            return queryset.filter(retries__gte=int(value[:-1]))
        if value.isdigit():
            return queryset.filter(retries=int(value))
        return queryset


class StateFilter(admin.SimpleListFilter):
    """Filter outbox rows by state: held until their ETA, waiting for a retry, or due now."""

    title = "state"
    parameter_name = "state"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [
            ("scheduled", "scheduled (held until its ETA)"),
            ("retrying", "waiting for a retry"),
            ("due", "due now"),
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        now = timezone.now()
        tried = Q(retries__gt=0) | Q(last_error__isnull=False)
        if self.value() == "scheduled":
            return queryset.filter(retry_after__gt=now).exclude(tried)
        if self.value() == "retrying":
            return queryset.filter(tried, retry_after__gt=now)
        if self.value() == "due":
            return queryset.filter(Q(retry_after__isnull=True) | Q(retry_after__lte=now))
        return queryset


class KindFilter(admin.SimpleListFilter):
    """Filter by what a row carries: a Celery task, or a domain event (outbox_notify.events)."""

    title = "kind"
    parameter_name = "kind"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("task", "Celery tasks"), ("event", "domain events")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if self.value() == "event":
            return queryset.filter(schema_version=EVENT_VERSION)
        if self.value() == "task":
            return queryset.exclude(schema_version=EVENT_VERSION)
        return queryset


def _preview(text: str | None) -> str:
    """The start of a long text for a list column."""
    return redaction.truncate(text or "", TEXT_PREVIEW)


def _header(obj: OutboxMessage | DeadLetter, key: str) -> Any:
    """One Celery message header from a row's stored options, None when absent."""
    options = obj.options if isinstance(obj.options, dict) else {}
    headers = options.get("headers")
    return headers.get(key) if isinstance(headers, dict) else None


def outbox_summary() -> stats.OutboxStats:
    """The figures shown above both changelists (no top_failing: the list shows those)."""
    return stats.collect(
        connections[conf.database_alias()], top=0, event_types=stats.DEFAULT_EVENT_TYPES
    )


class ReadOnlyAdmin(ModelAdmin):
    """Shared behaviour: read-only pages, the outbox database, a summary box, redaction."""

    change_list_template = "admin/outbox_notify/change_list.html"
    show_full_result_count = False  # a second count(*) over millions of rows per page
    list_per_page = 100
    search_fields = ("=task_id",)
    search_help_text = "Exact Celery task id."
    list_filter = (KindFilter, TaskNameFilter, RetriesFilter)
    sample_order = "id"

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        return super().get_queryset(request).using(conf.database_alias())

    def has_add_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        # Object pages stay read-only for everyone (the relay owns the rows); the model-level
        # answer is the user's real change permission, which is what the actions require.
        if obj is not None:
            return False
        return super().has_change_permission(request)

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        context = {**(extra_context or {}), "outbox_summary": outbox_summary()}
        return super().changelist_view(request, context)

    def task_name_sample(self, request: HttpRequest) -> list[str]:
        """Distinct task names among the first FILTER_SAMPLE rows in `sample_order`."""
        rows = self.get_queryset(request).order_by(self.sample_order)
        return list(set(rows.values_list("task_name", flat=True)[:FILTER_SAMPLE]))

    @admin.display(description="kind")
    def kind(self, obj: OutboxMessage | DeadLetter) -> str:
        """A Celery task, or a domain event (whose task name is the event type)."""
        return "event" if obj.schema_version == EVENT_VERSION else "task"

    @admin.display(description="arguments")
    def arguments(self, obj: OutboxMessage | DeadLetter) -> str:
        """The task's arguments (an event's data), redacted and truncated."""
        if obj.schema_version == EVENT_VERSION:
            return redaction.display_event(obj.task_name, obj.args)
        return redaction.display(obj.task_name, obj.args, obj.kwargs)

    @admin.display(description="eta")
    def eta(self, obj: OutboxMessage | DeadLetter) -> Any:
        """When the worker may run the task (Celery's eta header), if any."""
        return _header(obj, "eta") or "-"

    @admin.display(description="expires")
    def expires(self, obj: OutboxMessage | DeadLetter) -> Any:
        """When the worker discards the task unrun (Celery's expires header), if any."""
        return _header(obj, "expires") or "-"

    @admin.display(description="routing key")
    def routing_key(self, obj: OutboxMessage | DeadLetter) -> Any:
        """The routing key (queue) the message is published with."""
        options = obj.options if isinstance(obj.options, dict) else {}
        return compact.routing_key_of(options) or "-"

    def log_rows(self, request: HttpRequest, rows: Sequence[Model], message: str) -> None:
        """One admin LogEntry per row an action changed."""
        for row in rows:
            self.log_change(request, row, message)


@admin.register(OutboxMessage)
class OutboxMessageAdmin(ReadOnlyAdmin):
    """Outbox rows awaiting publication; action: reset retries."""

    list_display = (
        "id",
        "kind",
        "task_name",
        "task_id",
        "retries",
        "retry_after",
        "eta",
        "last_error_preview",
        "created_at",
        "arguments",
    )
    list_filter = (StateFilter, KindFilter, TaskNameFilter, RetriesFilter)  # type: ignore[assignment]
    fields = readonly_fields = (
        "id",
        "kind",
        "task_id",
        "task_name",
        "arguments",
        "routing_key",
        "eta",
        "expires",
        "retries",
        "retry_after",
        "last_error",
        "schema_version",
        "created_at",
    )
    actions = ("reset_retries", "cancel")

    def get_urls(self) -> list[URLPattern]:
        """The changelist's URLs and the Outbox dashboard (dashboard/, view permission)."""
        dashboard = path(
            "dashboard/",
            self.admin_site.admin_view(self.dashboard_view),
            name="outbox_notify_dashboard",
        )
        return [dashboard, *super().get_urls()]

    def dashboard_view(self, request: HttpRequest) -> HttpResponse:
        """The Outbox dashboard (outbox_notify/dashboard.py), for staff who may view the outbox."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        window = request.GET.get("window", "hour")
        context = {
            **self.admin_site.each_context(request),
            **dashboard.collect(window if window in dashboard.WINDOWS else "hour"),
            "title": "Outbox dashboard",
            "opts": self.model._meta,
        }
        return TemplateResponse(request, "admin/outbox_notify/dashboard.html", context)

    @admin.display(description="last error")
    def last_error_preview(self, obj: OutboxMessage) -> str:
        """The start of the last publish error."""
        return _preview(obj.last_error)

    @admin.action(permissions=["change"], description="Reset retries (due now, full retry budget)")
    def reset_retries(self, request: HttpRequest, queryset: QuerySet[OutboxMessage]) -> None:
        """Reset retries of the selected rows a relay does not hold right now."""
        selected = {
            row_id: OutboxMessage(id=row_id, task_id=task_id, task_name=task_name)
            for row_id, task_id, task_name in queryset.values_list("id", "task_id", "task_name")
        }
        reset = reset_retries(list(selected))
        self.log_rows(request, [selected[i] for i in reset], "Reset retries (admin action).")
        skipped = len(selected) - len(reset)
        self.message_user(
            request,
            f"Reset retries of {len(reset)} messages; skipped {skipped} "
            "(held by a relay right now, already published, or held until their ETA: "
            "use Cancel to remove those).",
            messages.WARNING if skipped else messages.SUCCESS,
        )

    @admin.action(permissions=["change"], description="Cancel: remove from the outbox unpublished")
    def cancel(self, request: HttpRequest, queryset: QuerySet[OutboxMessage]) -> None:
        """Remove the selected rows (held until their ETA, or not yet published) for good."""
        selected = {
            row_id: OutboxMessage(id=row_id, task_id=task_id, task_name=task_name)
            for row_id, task_id, task_name in queryset.values_list("id", "task_id", "task_name")
        }
        cancelled = held.cancel_rows(list(selected), alias=conf.database_alias(), app=_celery_app())
        self.log_rows(
            request,
            [selected[row.id] for row in cancelled],
            "Cancelled: removed from the outbox before it was published (admin action).",
        )
        skipped = len(selected) - len(cancelled)
        self.message_user(
            request,
            f"Cancelled {len(cancelled)} messages ({sum(r.held for r in cancelled)} held until "
            f"their ETA); skipped {skipped} (being published by a relay right now, or already "
            "published).",
            messages.WARNING if skipped else messages.SUCCESS,
        )


def _celery_app() -> Any:
    """The relay's Celery app, to mark cancelled tasks REVOKED; None when it is not set."""
    try:
        return conf.celery_app() if conf.celery_app_path() else None
    except ConfigurationError:
        return None


def reset_retries(ids: list[int]) -> list[int]:
    """Reset retries of these outbox rows, skipping rows a relay holds; return the ids reset."""
    if not ids:
        return []
    with connections[conf.database_alias()].cursor() as cur:
        cur.execute(stats.queries()["reset_retries"], {"ids": ids})
        reset = [int(row[0]) for row in cur.fetchall()]
        if reset:
            cur.execute(stats.queries()["wake_relays"])
    return reset


@admin.register(OutboxDashboard)
class OutboxDashboardAdmin(ModelAdmin):
    """The "Outbox dashboard" row of the admin index and app page: its link redirects to the
    dashboard. No template or AdminSite of the project is touched; who sees the row is who
    may view outbox messages, as for the dashboard itself."""

    def has_view_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return request.user.has_perm("outbox_notify.view_outboxmessage") or request.user.has_perm(
            "outbox_notify.change_outboxmessage"
        )

    def has_module_permission(self, request: HttpRequest) -> bool:
        return self.has_view_permission(request)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False

    def get_urls(self) -> list[URLPattern]:
        """Only the changelist URL, the index's link: there are no objects to show."""
        info = self.opts.app_label, self.opts.model_name
        view = self.admin_site.admin_view(self.changelist_view)
        return [path("", view, name="{}_{}_changelist".format(*info))]

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        """Redirect to the dashboard (which checks the permission again)."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        return HttpResponseRedirect(reverse(f"{self.admin_site.name}:outbox_notify_dashboard"))


@admin.register(DeadLetter)
class DeadLetterAdmin(ReadOnlyAdmin):
    """Messages the relay gave up on; action: requeue to the outbox."""

    sample_order = "-dead_at"
    list_display = (
        "id",
        "kind",
        "task_name",
        "task_id",
        "retries",
        "failure_reason_preview",
        "dead_at",
        "created_at",
        "arguments",
    )
    fields = readonly_fields = (
        "id",
        "kind",
        "task_id",
        "task_name",
        "arguments",
        "routing_key",
        "eta",
        "expires",
        "retries",
        "failure_reason",
        "schema_version",
        "created_at",
        "dead_at",
    )
    actions = ("requeue",)

    @admin.display(description="failure reason")
    def failure_reason_preview(self, obj: DeadLetter) -> str:
        """The start of the reason the relay gave up."""
        return _preview(obj.failure_reason)

    @admin.action(permissions=["change"], description="Requeue to the outbox (retries reset)")
    def requeue(self, request: HttpRequest, queryset: QuerySet[DeadLetter]) -> None:
        """Move the selected dead letters back to the outbox."""
        selected = {
            row_id: DeadLetter(id=row_id, task_id=task_id, task_name=task_name)
            for row_id, task_id, task_name in queryset.values_list("id", "task_id", "task_name")
        }
        if not selected:
            return
        result = deadletter.requeue(deadletter.Selector(ids=tuple(selected)))
        left = set(self.get_queryset(request).filter(id__in=selected).values_list("id", flat=True))
        moved = [row for row_id, row in selected.items() if row_id not in left]
        self.log_rows(request, moved, "Requeued to the outbox (admin action).")
        self.message_user(
            request,
            f"Requeued {len(moved)} dead letters; skipped {len(selected) - len(moved)} "
            "(held by another requeue or purge right now, or already gone).",
            messages.SUCCESS if len(moved) == len(selected) else messages.WARNING,
        )
        if result.already_expired:
            self.message_user(
                request,
                f"{result.already_expired} of them carry an absolute expiry that has already "
                "passed; workers will discard them as expired.",
                messages.WARNING,
            )


@admin.register(InboxRecord)
class InboxRecordAdmin(ModelAdmin):
    """OnceTask keys: which delivery committed each key, and when. Read-only, no actions.

    A key is removed only by the retention purge (`outbox_purge_inbox`): deleting one by hand
    would let a duplicate delivery of that key run its body again.
    """

    show_full_result_count = False  # a second count(*) over millions of rows per page
    list_per_page = 100
    list_display = ("id", "scope", "key", "task_name", "task_id", "created_at")
    fields = readonly_fields = list_display
    list_filter = (TaskNameFilter,)
    search_fields = ("=key", "=task_id")
    search_help_text = "Exact key or Celery task id."
    actions = None

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        return super().get_queryset(request).using(conf.database_alias())

    def has_add_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False

    def task_name_sample(self, request: HttpRequest) -> list[str]:
        """Distinct task names among the newest FILTER_SAMPLE keys."""
        rows = self.get_queryset(request).order_by("-id")
        return list(set(rows.values_list("task_name", flat=True)[:FILTER_SAMPLE]))
