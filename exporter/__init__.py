"""cache-config-exporter: the HTTP service, its storage, its collector and its CLI."""

__version__ = "0.1.0"
