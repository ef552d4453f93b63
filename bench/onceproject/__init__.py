"""The project bench.once runs its Celery worker with: settings and tasks, nothing else."""
