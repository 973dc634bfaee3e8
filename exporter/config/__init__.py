"""The options as the command line joins them: ``Settings`` inherits the web group (``exporter.security``) and
the probe's (``exporter.probe``), declares the state's and the output's with the value types they parse into
(limits, label choices), parses ``serve``'s flags and environment variables and checks the groups together.

May import security, the probe and the exposition, whose groups it joins, and what they may; never the server,
which reads its options from here.
"""
