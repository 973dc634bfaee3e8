"""The benchmark harness: the exporter against Pushgateway, prometheus_client and a bare floor server, with the
performance targets the exporter holds itself to (docs/PERFORMANCE.md)."""
