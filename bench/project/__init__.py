"""The benchmark's own Django project: both outboxes, each in its own database."""
