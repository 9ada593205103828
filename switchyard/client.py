"""The Python client, ``switchyard.client.SwitchyardClient`` (it lives in ``wiring.client``,
below the rooms that use it: the batch engine and the HTTP gateway)."""

from wiring.client import SwitchyardClient

__all__ = ["SwitchyardClient"]
