"""AppConfig of the benchmark app."""

from __future__ import annotations

from django.apps import AppConfig


class BenchAppConfig(AppConfig):
    """Imports the tasks once Django is ready."""

    name = "bench.project.benchapp"
    label = "benchapp"

    def ready(self) -> None:
        from bench.project.benchapp import tasks  # noqa: F401 - registers the tasks
