"""The plugin's tests start stand-ins for whatever answers at its URL with the ``stand_in`` fixture."""

from tests.plugin.standins import stand_in  # noqa: F401  (a fixture)
