"""The lowest floor: what the project takes from its dependencies' private parts, behind
one name each (:mod:`compat.mlx_lm`), so that a release that moves one is fixed in one
place and caught by one test (``tests/test_compat.py``). Imports nothing of ``cache``,
``scheduler`` or ``gateway``; every floor may import it."""
