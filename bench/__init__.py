"""The benchmark harness of issue 4: the exporter against Pushgateway, prometheus_client and a bare floor server."""
