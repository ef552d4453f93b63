"""Django app configuration of the example shop."""

from __future__ import annotations

from django.apps import AppConfig


class ShopConfig(AppConfig):
    """The example shop: orders and the record of their fulfilment."""

    name = "example.shop"
    label = "shop"
    default_auto_field = "django.db.models.BigAutoField"
