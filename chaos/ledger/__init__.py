"""The chaos project's Django app: business rows committed with each message, and executions."""
