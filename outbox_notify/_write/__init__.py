"""The write side's internals: message templates, deferred rows, row writing, write settings.

Private: users import `OutboxCelery` and `bulk` from `outbox_notify`.
"""
