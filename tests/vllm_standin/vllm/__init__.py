"""A stand-in for the parts of vLLM the plugin touches; tests put its parent folder on ``sys.path``."""
