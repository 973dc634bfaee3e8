"""The state: the replicas and their engines' ready responses, the rules of each change, the limits, the one
writer thread that commits them and the SQLite store behind it.

May import ``protocol`` and ``exporter.errors`` only; imports no web or metrics library.
"""
