"""The probe (``/probe?target=``): fetch a stock vLLM server's ``/metrics`` with bounded cost and read its
``vllm:cache_config_info`` into a replica, for Prometheus to scrape through the exporter.

May import the options and what they may (the file watcher, the state's replica types, the exposition's lines);
never security, the server or the vLLM plugin.
"""
