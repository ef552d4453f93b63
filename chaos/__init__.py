"""Fault injection under load for outbox-notify: `python -m chaos.run` (see docs/reliability.md).

Everything runs on servers this package starts itself: a private PostgreSQL (devtools.pgserver)
and a private redis-server on a free port, so faults (restarts, stops) never touch a shared
service.
"""
