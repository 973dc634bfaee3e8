"""Helpers the tests share, one module per concern (HTTP, the exposition, the disk, processes, figures...)."""
