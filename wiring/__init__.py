"""The low room: settings (addresses, credentials), topic names, Kafka admin helpers, paths.

``state/``, ``streams/``, ``workers/`` and the CLI import it; it imports only ``schemas``.
"""
