"""The relay: turns committed outbox rows into broker messages."""
