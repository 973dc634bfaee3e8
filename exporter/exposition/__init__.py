"""The exposition: which series a replica has, rendered as Prometheus text or OpenMetrics (gzip too), the
JSON views and pages of the state, and the exporter's own metrics; and the output's options group
(``OutputOptions``: how the metrics look, and the log).

May import the state (and what it may: ``protocol``, ``exporter.errors``, ``exporter.flags``); never the command
line's options, security, the probe or the server.
"""
