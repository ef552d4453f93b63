"""A tiny shop: orders placed in transactions, fulfilled by a Celery task through the outbox."""
