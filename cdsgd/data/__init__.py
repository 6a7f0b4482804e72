"""Data sets (read from disk in their standard formats) and partitions among agents.

See docs/data.md. ``load_dataset(name, data_dir)`` gives a :class:`Dataset`
of tensors (images, padded sequences, or byte-level text from
:mod:`.corpora` and :mod:`.text`); ``partition(labels, n_agents, scheme)``
splits its training set among the agents.
"""

from .datasets import *  # noqa: F401,F403
from .datasets import __all__ as _datasets_all
from .partition import *  # noqa: F401,F403
from .partition import __all__ as _partition_all
from .sequences import *  # noqa: F401,F403
from .sequences import __all__ as _sequences_all
from .corpora import *  # noqa: F401,F403
from .corpora import __all__ as _corpora_all
from .text import *  # noqa: F401,F403
from .text import __all__ as _text_all

__all__ = [*_datasets_all, *_partition_all, *_sequences_all, *_corpora_all, *_text_all]
