"""mlx-lm's private functions the project relies on, under public names.

mlx-lm (pinned to a minor release in ``pyproject.toml``) exports none of these; each is
imported here only, and ``tests/test_compat.py`` checks that each still behaves as its
callers rely on (arguments, what it returns), so a release that renames or changes one
fails there, naming it, instead of deep in a request.

- :func:`download`: a local directory or hub id -> the local model directory
  (``mlx_lm.utils._download``).
- :func:`get_classes`: a ``config.json`` dict -> ``(Model class, ModelArgs class)``
  (``mlx_lm.utils._get_classes``).
- :func:`merge_caches`: per sequence, its list of layer caches -> per layer, one batch
  cache, left-padded (``mlx_lm.generate._merge_caches``).
- :func:`extend_cache`: two per-layer batch caches -> the first with the second's rows
  after its own (``mlx_lm.generate._extend_cache``).
- :func:`byte_decoder`: GPT-2's byte-level BPE map, character -> byte value
  (``mlx_lm.tokenizer_utils._byte_decoder``).
"""

from __future__ import annotations

from mlx_lm.generate import _extend_cache as extend_cache
from mlx_lm.generate import _merge_caches as merge_caches
from mlx_lm.tokenizer_utils import _byte_decoder as byte_decoder
from mlx_lm.utils import _download as download
from mlx_lm.utils import _get_classes as get_classes

__all__ = ["byte_decoder", "download", "extend_cache", "get_classes", "merge_caches"]
