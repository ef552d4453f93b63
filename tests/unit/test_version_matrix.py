"""The version matrix agrees with itself: pyproject's ranges, constraints/*.txt, outbox_notify/_compat.py.

`make test` runs the suite on constraints/oldest.txt and constraints/newest.txt (noxfile.py).
These checks keep the declared ranges honest: every lower bound is what the oldest session
installs, every newest pin is inside the declared range, and the fast paths' gates open on
exactly the releases between the two sessions, where their equivalence tests ran.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from outbox_notify import _compat

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
# The runtime libraries (and the optional ones users install) whose releases the matrix pins.
PINNED = ("django", "celery", "kombu", "psycopg", "structlog", "redis", "orjson", "sentry-sdk", "datadog", "opentelemetry-api")  # fmt: skip


def _pins(session: str) -> dict[str, Version]:
    pins = {}
    for raw in (ROOT / "constraints" / f"{session}.txt").read_text(encoding="utf-8").splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[name.strip().lower()] = Version(version.strip())
    return pins


def _declared() -> dict[str, Requirement]:
    project = PYPROJECT["project"]
    optional = [r for extra in ("redis", "fast", "sentry", "datadog", "otel") for r in project["optional-dependencies"][extra]]  # fmt: skip
    found = {}
    for text in [*project["dependencies"], *optional]:
        requirement = Requirement(text)
        # An extra may name a dependency again for its own extras (`kombu[redis]`) and leave
        # the range to the main list, which pip applies to both.
        if requirement.specifier or requirement.name.lower() not in found:
            found[requirement.name.lower()] = requirement
    return found


def _lower_bound(requirement: Requirement) -> Version:
    (lower,) = [Version(s.version) for s in requirement.specifier if s.operator == ">="]
    return lower


@pytest.mark.parametrize("name", PINNED)
def test_the_oldest_session_installs_each_lower_bound(name: str) -> None:
    """Each declared lower bound is exactly the release the oldest session pins."""
    assert _pins("oldest")[name] == _lower_bound(_declared()[name])


@pytest.mark.parametrize("session", ["oldest", "newest"])
def test_every_pin_is_inside_the_declared_range(session: str) -> None:
    """No session tests a release pyproject excludes (an upper bound moves with the pins)."""
    declared = _declared()
    outside = [
        f"{name} {version}"
        for name, version in _pins(session).items()
        if name in declared and not declared[name].specifier.contains(version)
    ]
    assert outside == []


def test_the_sessions_python_is_the_declared_minimum() -> None:
    """The oldest session runs the Python that requires-python names as the minimum."""
    # Read, not imported: nox itself is not installed in the sessions' own venvs.
    noxfile = (ROOT / "noxfile.py").read_text(encoding="utf-8")
    (oldest,) = re.findall(r'^OLDEST_PYTHON = "([0-9.]+)"$', noxfile, re.MULTILINE)
    assert PYPROJECT["project"]["requires-python"] == f">={oldest}"


@pytest.mark.parametrize(
    ("distribution", "tested"),
    [
        ("kombu", _compat.KOMBU_TESTED),
        ("amqp", _compat.AMQP_TESTED),
        ("redis", _compat.REDIS_TESTED),
        ("psycopg", _compat.PSYCOPG_TESTED),
        ("django", _compat.DJANGO_TESTED),
    ],
)
def test_fast_path_gates_span_exactly_the_matrix(
    distribution: str, tested: tuple[tuple[int, int], tuple[int, int]]
) -> None:
    """A gate opens from the oldest session's minor release to the newest one's, no further."""
    minors = [(v.major, v.minor) for v in (_pins(s)[distribution] for s in ("oldest", "newest"))]
    assert tuple(minors) == tested
