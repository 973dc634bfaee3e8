"""cache-config-exporter: the server (``server``), its state (``state``), the exposition (``exposition``),
security (``security``), the probe of stock vLLM (``probe``), the options (``config``), the command line
(``cli``), and the vLLM plugin that runs inside vLLM's processes (``vllm_plugin``).

This face holds the version only, so that the plugin may import it without anything of the server.
"""

__version__ = "0.1.0"
