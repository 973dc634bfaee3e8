"""The probe (``/probe?target=``): fetch a stock vLLM server's ``/metrics`` with bounded cost and read its
``vllm:cache_config_info`` into a replica, for Prometheus to scrape through the exporter; the allowlist of
targets, decided without DNS, and the probe's group of options (``options.ProbeOptions``, ``--probe.*``).

May import how flags are declared and files watched (``exporter.flags``), the exposition and what it may (the
state's replica types, the exposition's lines); never the command line's options (``exporter.config``),
security, the server or the vLLM plugin.
"""
