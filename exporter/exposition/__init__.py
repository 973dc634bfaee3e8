"""The exposition: which series a replica has, rendered as Prometheus text or OpenMetrics (gzip too), the
JSON views and pages of the state, and the exporter's own metrics.

May import the state (and what it may: ``protocol``, ``exporter.errors``); never the options, security, the
probe or the server.
"""
