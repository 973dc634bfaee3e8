"""Security: ingest and change tokens, the web config file (basic auth users, TLS, headers), bounded bcrypt
checks and their cache, TLS contexts, token files, the listen address and the web group of options
(``options.WebOptions``, ``--web.*``), whose flags it names in its own messages.

May import how flags are declared and files watched (``exporter.flags``), ``exporter.errors`` and ``protocol``;
never the command line's options (``exporter.config``), the probe or the server.
"""
