"""The workers room's shared fixture: ``env`` (settings, Redis store, producer, client) of
``test_worker.py``, for the other worker test modules."""

from tests.workers.test_worker import env  # noqa: F401
