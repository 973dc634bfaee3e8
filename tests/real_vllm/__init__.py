"""Helpers for the tests against a real vLLM; the scripts here run with the Python of the vLLM venv."""
