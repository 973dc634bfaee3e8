"""The options: ``serve``'s flags and environment variables, declared once, parsed and checked into
``Settings``, with the value types they parse into (limits, label choices, the probe's allowlist), and the
files options name, loaded again when they change (``watched_files``: certificates, tokens, the probe's secrets).

May import the exposition and the state (the value types of their options: limits, label choices) and what
they may; never security, the probe or the server, which read their options from here.
"""
