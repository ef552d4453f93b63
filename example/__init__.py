"""An example Django project using outbox-notify, and the end-to-end demo that drives it."""
