"""cdsgd: decentralized collaborative learning over a fixed communication graph.

N agents train one model together, each exchanging parameters only with its
graph neighbours (CDSGD/CDMSGD, Jiang et al., NIPS 2017). Graphs and mixing
matrices live in the sibling package :mod:`topologies`.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
