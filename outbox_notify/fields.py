"""A JSON model field stored as PostgreSQL `json`, whose text is kept as written."""

from __future__ import annotations

import json
from typing import Any

from django.db import models
from django.db.backends.base.base import BaseDatabaseWrapper


class JSONTextField(models.JSONField):
    """JSONField over a `json` column: reads decode the exact text the write side stored."""

    def db_type(self, connection: BaseDatabaseWrapper) -> str:
        return "json"

    def from_db_value(self, value: Any, expression: Any, connection: BaseDatabaseWrapper) -> Any:
        # psycopg decodes `json` columns itself (Django only turns that off for jsonb).
        if value is None or not isinstance(value, str | bytes):
            return value
        return json.loads(value)

    def get_db_prep_value(
        self, value: Any, connection: BaseDatabaseWrapper, prepared: bool = False
    ) -> Any:
        if value is None:
            return None
        from psycopg.types.json import Json

        return Json(value)
