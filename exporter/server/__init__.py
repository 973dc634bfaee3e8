"""The HTTP server: the app factory, its routes and their queries, the request guard at the door (uvicorn's
protocol), heartbeats answered in the protocol, the one table of refusals, the status page and ``/docs``.

Owns every import of Starlette and uvicorn (the command line starts uvicorn). May import every part below it and
``protocol``; never the vLLM plugin. Only ``exporter.cli`` imports it.
"""
