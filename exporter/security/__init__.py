"""Security: ingest and change tokens, the web config file (basic auth users, TLS, headers), bounded bcrypt
checks and their cache, TLS contexts, token files and the watched files they are reloaded from.

May import the options (``exporter.config``) and what they may, ``exporter.errors`` and ``protocol``; never the
probe or the server.
"""
