"""A stand-in for the parts of vLLM 0.32.0 the plugin touches: the same module paths, names and signatures.

Tests put its parent folder on ``sys.path`` when the real vLLM is not installed;
``tests/real_vllm/test_real_vllm.py`` runs the same tests against the real package and checks
that this copy still matches it.
"""
