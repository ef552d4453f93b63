"""AMQP message properties serialised as py-amqp serialises them, reusing repeated values' bytes.

py-amqp encodes every message's properties, the Celery header table above all, in pure Python:
about two thirds of the relay's CPU per RabbitMQ message. Most of a batch's header values
repeat from one message to the next (the task name, `lang`, `eta`, `timelimit`, ...), and in
an AMQP field table each entry is encoded on its own and the entries are concatenated. So the
bytes of each entry and of each property field are remembered with the last value they
encoded, and py-amqp's own `dumps` encodes whatever differs. The result is the same bytes
(tests/unit/test_amqp_properties.py compares them with py-amqp's for generated messages).
"""

from __future__ import annotations

import copy
from struct import pack
from typing import Any

import amqp
from amqp.serialization import dumps

_SCALARS = (str, int, bool, type(None), bytes)  # not float: 0.0 == -0.0, encoded differently
_KEYS_REMEMBERED = 1024  # distinct header names (and property names) remembered


def _same(a: Any, b: Any) -> bool:
    """Equal and of the same types all the way down (True == 1, but encodes differently)."""
    kind = type(a)
    if kind is not type(b):
        return False
    if kind is str or kind is int or kind is bool or a is None or kind is bytes:
        return bool(a == b)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(v, b[k]) for k, v in a.items())
    return False  # anything else is encoded afresh every time


class PropertyWriter:
    """Serialises basic-class properties; remembers the last value of each field and entry."""

    def __init__(self) -> None:
        self.fields: dict[str, tuple[Any, bytes]] = {}
        self.entries: dict[str, tuple[Any, bytes]] = {}

    def serialize(self, properties: dict[str, Any]) -> bytes:
        """The property flags and list of a content header, as py-amqp writes them."""
        flags, flag_bits, shift = [], 0, 15
        parts: list[bytes] = []
        for key, kind in amqp.Message.PROPERTIES:
            value = properties.get(key)
            if value is not None:
                if shift == 0:
                    flags.append(flag_bits)
                    flag_bits, shift = 0, 15
                flag_bits |= 1 << shift
                parts.append(self._table(value) if kind == "F" else self._field(key, kind, value))
            shift -= 1
        flags.append(flag_bits)
        return b"".join([*(pack(">H", f) for f in flags), *parts])

    def _field(self, key: str, kind: str, value: Any) -> bytes:
        last = self.fields.get(key)
        if last is not None and _same(last[0], value):
            return last[1]
        if kind == "s" and type(value) is str:
            # py-amqp's shortstr: a length octet (struct refuses > 255), then UTF-8.
            raw = value.encode("utf-8", "surrogatepass")
            encoded = pack("B", len(raw)) + raw
        else:
            encoded = dumps(kind, (value,))
        self._remember(self.fields, key, value, encoded)
        return encoded

    def _table(self, table: dict[str, Any]) -> bytes:
        encoded = b"".join([self._entry(key, value) for key, value in table.items()])
        return pack(">I", len(encoded)) + encoded

    def _entry(self, key: str, value: Any) -> bytes:
        last = self.entries.get(key)
        if last is not None and _same(last[0], value):
            return last[1]
        if type(value) is str:
            # py-amqp's table entry for a string: shortstr name, 'S', long length, UTF-8.
            name = key.encode("utf-8", "surrogatepass")
            raw = value.encode("utf-8", "surrogatepass")
            encoded = pack("B", len(name)) + name + pack(">cI", b"S", len(raw)) + raw
        else:
            encoded = dumps("F", ({key: value},))[4:]  # without the table's length
        self._remember(self.entries, key, value, encoded)
        return encoded

    @staticmethod
    def _remember(
        memory: dict[str, tuple[Any, bytes]], key: str, value: Any, encoded: bytes
    ) -> None:
        if len(memory) >= _KEYS_REMEMBERED and key not in memory:
            memory.clear()
        # A container is copied: the caller may change it after this message is written.
        memory[key] = (value if isinstance(value, _SCALARS) else copy.deepcopy(value), encoded)


# py-amqp writes each field independently only while no property is a bit field.
AVAILABLE = all(kind != "bit" for _, kind in amqp.Message.PROPERTIES)


class Message(amqp.Message):
    """py-amqp's Message, its properties serialised by the shared PropertyWriter."""

    writer = PropertyWriter()

    def _serialize_properties(self) -> bytes:
        return self.writer.serialize(self.properties)
