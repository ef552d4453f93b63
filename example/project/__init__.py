"""The example project's settings and Celery app."""
