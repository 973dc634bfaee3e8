"""The vLLM general plugin: the code that runs inside vLLM's processes (the frontend and the engine cores).

It adds the engine core's KV-cache groups to its ready response, and sends ready responses, static labels,
heartbeats and goodbyes to the exporters. It imports the standard library, msgspec, ``protocol`` and the
package's version (``exporter.__version__``) only: nothing of the server, no web or metrics library (vLLM's
processes must not pay for them).
``register`` is the entry point vLLM calls (``vllm.general_plugins``).
"""

from exporter.vllm_plugin.plugin import register

__all__ = ["register"]
