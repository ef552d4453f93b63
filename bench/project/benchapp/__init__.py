"""The benchmark's Django app: one trivial task, registered with each Celery app."""
