"""How a flag is declared (``Option``, ``setting``: its name, environment variable, default and help, once) and
how the files flags name are read and watched for changes (``Watched``). Every part that owns an options group
declares it with these, and names its own flags in its messages, without the command line that joins the groups.

Imports nothing of the project: the state declares its options with it (secrets are read by
``exporter/secret_files.py``, above it).
"""
