"""The state: the replicas and their engines' ready responses, the rules of each change, the limits, the one
writer thread that commits them and the SQLite store behind it; and the state's options group
(``StateOptions``: what is kept and where).

May import ``protocol``, ``exporter.errors`` and ``exporter.flags`` (how its options are declared) only; imports no
web or metrics library.
"""
