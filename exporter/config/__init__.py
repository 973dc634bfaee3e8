"""The options as the command line joins them: ``Settings`` inherits each part's group, the web's
(``exporter.security``), the probe's (``exporter.probe``), the state's (``exporter.state``) and the output's
(``exporter.exposition``), parses ``serve``'s flags and environment variables and checks the groups together.

May import security, the probe and the exposition, whose groups it joins, and what they may; never the server,
which reads its options from here.
"""
