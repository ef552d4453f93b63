"""Print the Python and the releases of the libraries outbox-notify supports, on one line.

The nox sessions run it first, so a log of `make test` says which releases each run tested.
"""

from __future__ import annotations

import importlib.metadata
import platform

DISTRIBUTIONS = ("Django", "celery", "kombu", "amqp", "redis", "psycopg", "structlog")


def line() -> str:
    """`python 3.11.7 | Django 4.2 | celery 5.3.6 | ...` for this interpreter."""
    found = []
    for name in DISTRIBUTIONS:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name} (not installed)")
    return " | ".join([f"python {platform.python_version()}", *found])


if __name__ == "__main__":
    print(line())
