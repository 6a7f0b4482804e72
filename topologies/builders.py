"""Named graph builders: ``build(name, n, **params) -> networkx.Graph``.

Every builder returns a simple, undirected, connected graph on the nodes
``0 .. n-1``, except the ``directed_*`` ones: strongly connected directed
graphs, for push-sum (``mixing=push_sum``, ``algorithm=sgp``). Randomised
builders take a ``seed`` and are deterministic under it; a disconnected draw
is redrawn from a stream derived from (seed, redraw) (:func:`draw_seed`), and
``G.graph["draw"]`` records the draw used.

==================  ==========================================  ==================
name                graph                                       parameters
==================  ==========================================  ==================
``complete``        every pair linked; degree n-1               --
``ring``            i ~ i±1 (mod n); degree 2, n >= 3           --
``path``            i ~ i+1; degrees 1 (ends) and 2             --
``star``            0 ~ every other node                        --
``torus``           2-D periodic grid, rows x cols = n; deg 4   rows, cols (>= 3)
``grid``            2-D grid without wrap-around, rows x cols   rows, cols
``hypercube``       i ~ i xor 2^k; n a power of two; deg log2 n --
``exponential``     i ~ i±2^k (mod n) for 2^k < n               --
``erdos_renyi``     G(n, p), redrawn until connected            p, seed, max_tries
``small_world``     Watts-Strogatz, redrawn until connected     k, p, seed, max_tries
``random_regular``  random d-regular, redrawn until connected   d, seed, max_tries
``directed_ring``   i → i+1 (mod n); one in, one out            --
``directed_exponential``  i → i+2^k (mod n) for 2^k < n         --
==================  ==========================================  ==================

Grid-shaped graphs number node (r, c) as ``r * cols + c`` (row-major) and
record ``G.graph["shape"] = (rows, cols)``. When
``rows``/``cols`` are not given, the factorisation of n closest to a square is
used (for ``torus`` the closest one with both sides >= 3).

Example::

    >>> G = build("ring", 8)
    >>> sorted(d for _, d in G.degree()) == [2] * 8
    True
"""

from __future__ import annotations

import inspect
import math
import numbers
from typing import Any, Callable

import networkx as nx

from .registry import Registry

__all__ = ["build", "BUILDERS", "builder_params", "draw_seed"]

BUILDERS: Registry[Callable[..., nx.Graph]] = Registry("topology")


# ---------------------------------------------------------------------------
# parameter checks (each names the bad value and the allowed range)


def _int(name: str, value: Any, *, low: int, what: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer >= {low}{what}, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be an integer >= {low}{what}, got {value!r}")
    return int(value)


def _prob(name: str, value: Any, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
        raise ValueError(f"{name} must be a number in {'[0' if allow_zero else '(0'}, 1], got {value!r}")
    lo_ok = value >= 0 if allow_zero else value > 0
    if not (lo_ok and value <= 1):
        raise ValueError(f"{name} must be a number in {'[0' if allow_zero else '(0'}, 1], got {value!r}")
    return float(value)


def _seed(value: Any) -> int | None:
    if value is None:
        return None
    return _int("seed", value, low=0)


def draw_seed(seed: int, redraw: int) -> int:
    """The seed a random builder passes to networkx for draw number ``redraw`` (0: the first) under ``seed``.

    The first draw uses ``seed`` itself; redraw k >= 1 a 63-bit seed (a TOML
    integer) from ``numpy.random.SeedSequence((seed, k))``: a stream of its
    own for every (seed, k), so that seed S's k-th redraw is not seed S+k's
    first draw (earlier versions redrew with ``seed + k``: seeds 0 to 4 of a
    sparse G(n, p) all gave one graph) and distinct seeds give distinct
    graphs. ``G.graph["draw"]`` records the one a built graph used; given as
    ``seed`` it builds that graph at the first draw.

        >>> draw_seed(3, 0), draw_seed(3, 1) == draw_seed(4, 0), draw_seed(3, 1) == draw_seed(3, 1)
        (3, False, True)
    """
    if redraw == 0:
        return int(seed)
    import numpy as np

    return int(np.random.SeedSequence((int(seed), int(redraw))).generate_state(1, dtype=np.uint64)[0]) >> 1


def _connected_draw(name: str, draw: Callable[[int], nx.Graph], seed, max_tries) -> nx.Graph:
    """Redraw a random graph until it is connected, at most ``max_tries`` times.

    Draw k uses :func:`draw_seed` ``(seed, k)``, so the result is deterministic
    under seed (seed None: fresh entropy, recorded). The graph records the
    draw it came from in ``G.graph["draw"] = {"seed": s, "redraws": k}``:
    ``draw(s)`` alone, or the builder with ``seed=s``, gives it again.
    """
    seed = _seed(seed)
    max_tries = _int("max_tries", max_tries, low=1)
    if seed is None:
        import numpy as np

        base = int(np.random.SeedSequence().generate_state(1, dtype=np.uint32)[0])
    else:
        base = seed
    for k in range(max_tries):
        s = draw_seed(base, k)
        G = draw(s)
        if G.number_of_nodes() > 0 and nx.is_connected(G):
            G.graph["draw"] = {"seed": s, "redraws": k}
            return G
    raise ValueError(
        f"{name}: no connected graph in {max_tries} draws (seed={seed}); "
        "raise the edge probability/degree or max_tries"
    )


def _powers_of_two_below(n: int) -> list[int]:
    """1, 2, 4, ... up to the largest power of two below n."""
    return [1 << k for k in range((n - 1).bit_length())]


def _circulant(n: int, offsets: list[int], *, directed: bool = False) -> nx.Graph:
    """Nodes 0..n-1 with i → (i + s) mod n for every offset s (one undirected edge per pair unless directed)."""
    G = nx.DiGraph() if directed else nx.Graph()
    G.add_nodes_from(range(n))
    G.add_edges_from((i, (i + s) % n) for s in offsets for i in range(n) if (i + s) % n != i)
    return G


def _factor_pairs(n: int, min_side: int) -> list[tuple[int, int]]:
    return [(r, n // r) for r in range(min_side, n // min_side + 1) if n % r == 0 and n // r >= min_side]


def _grid_shape(name: str, n: int, rows, cols, min_side: int) -> tuple[int, int]:
    if rows is None and cols is None:
        pairs = _factor_pairs(n, min_side)
        if not pairs:
            raise ValueError(
                f"{name}: n={n} cannot be written as rows x cols with both >= {min_side}; "
                "choose another n or give rows= and cols="
            )
        return min(pairs, key=lambda rc: (abs(rc[0] - rc[1]), rc[0]))
    if rows is None:
        cols = _int("cols", cols, low=min_side)
        rows = n // cols
    elif cols is None:
        rows = _int("rows", rows, low=min_side)
        cols = n // rows
    rows = _int("rows", rows, low=min_side)
    cols = _int("cols", cols, low=min_side)
    if rows * cols != n:
        raise ValueError(f"{name}: rows x cols must equal n, got rows={rows}, cols={cols}, n={n}")
    return rows, cols


def _relabel_grid(G: nx.Graph, cols: int) -> nx.Graph:
    H = nx.Graph()
    H.add_nodes_from(range(G.number_of_nodes()))
    H.add_edges_from(((a * cols + b), (c * cols + d)) for (a, b), (c, d) in G.edges())
    return H


# ---------------------------------------------------------------------------
# the builders


@BUILDERS.register("complete")
def complete(n: int) -> nx.Graph:
    """Every pair of agents linked: Π = 11ᵀ/n with Metropolis weights."""
    return nx.complete_graph(n)


@BUILDERS.register("ring")
def ring(n: int) -> nx.Graph:
    """Cycle 0-1-...-(n-1)-0 (n >= 3; for n = 2 use ``path``)."""
    _int("n", n, low=3, what=" for a ring (use 'path' for 2 nodes)")
    return nx.cycle_graph(n)


@BUILDERS.register("path")
def path(n: int) -> nx.Graph:
    """Line 0-1-...-(n-1)."""
    return nx.path_graph(n)


@BUILDERS.register("star")
def star(n: int) -> nx.Graph:
    """Node 0 linked to every other node."""
    return nx.star_graph(n - 1)


@BUILDERS.register("torus")
def torus(n: int, rows: int | None = None, cols: int | None = None) -> nx.Graph:
    """2-D periodic grid (rows, cols >= 3 so that every degree is 4)."""
    rows, cols = _grid_shape("torus", n, rows, cols, 3)
    G = _relabel_grid(nx.grid_2d_graph(rows, cols, periodic=True), cols)
    G.graph["shape"] = (rows, cols)
    return G


@BUILDERS.register("grid")
def grid(n: int, rows: int | None = None, cols: int | None = None) -> nx.Graph:
    """2-D grid without wrap-around."""
    rows, cols = _grid_shape("grid", n, rows, cols, 1)
    G = _relabel_grid(nx.grid_2d_graph(rows, cols), cols)
    G.graph["shape"] = (rows, cols)
    return G


@BUILDERS.register("hypercube")
def hypercube(n: int) -> nx.Graph:
    """log2(n)-dimensional hypercube: i ~ i xor 2^k."""
    if n & (n - 1):
        raise ValueError(f"hypercube: n must be a power of two, got n={n}")
    k = n.bit_length() - 1
    G = nx.Graph()
    G.add_nodes_from(range(n))
    G.add_edges_from((i, i ^ (1 << b)) for i in range(n) for b in range(k) if i < i ^ (1 << b))
    return G


@BUILDERS.register("exponential")
def exponential(n: int) -> nx.Graph:
    """i ~ (i ± 2^k) mod n for every 2^k < n (the undirected exponential graph)."""
    return _circulant(n, _powers_of_two_below(n))


@BUILDERS.register("directed_ring")
def directed_ring(n: int) -> nx.DiGraph:
    """i → (i + 1) mod n: every agent sends to one and receives from one (directed)."""
    return _circulant(n, [1], directed=True)


@BUILDERS.register("directed_exponential")
def directed_exponential(n: int) -> nx.DiGraph:
    """i → (i + 2^k) mod n for every 2^k < n (Assran et al. 2019's directed exponential graph)."""
    return _circulant(n, _powers_of_two_below(n), directed=True)


@BUILDERS.register("erdos_renyi")
def erdos_renyi(n: int, p: float = 0.5, seed: int | None = 0, max_tries: int = 100) -> nx.Graph:
    """G(n, p), redrawn until connected (draw k from :func:`draw_seed` ``(seed, k)``)."""
    p = _prob("p", p)
    return _connected_draw("erdos_renyi", lambda s: nx.gnp_random_graph(n, p, seed=s), seed, max_tries)


@BUILDERS.register("small_world")
def small_world(n: int, k: int = 4, p: float = 0.1, seed: int | None = 0, max_tries: int = 100) -> nx.Graph:
    """Watts-Strogatz: ring lattice with k nearest neighbours, each edge rewired with probability p."""
    k = _int("k", k, low=2)
    if k >= n:
        raise ValueError(f"small_world: k must be < n, got k={k}, n={n}")
    p = _prob("p", p, allow_zero=True)
    return _connected_draw("small_world", lambda s: nx.watts_strogatz_graph(n, k, p, seed=s), seed, max_tries)


@BUILDERS.register("random_regular")
def random_regular(n: int, d: int = 3, seed: int | None = 0, max_tries: int = 100) -> nx.Graph:
    """Uniform random d-regular graph, redrawn until connected (n*d must be even, d < n)."""
    d = _int("d", d, low=1)
    if d >= n:
        raise ValueError(f"random_regular: d must be < n, got d={d}, n={n}")
    if (n * d) % 2:
        raise ValueError(f"random_regular: n*d must be even, got n={n}, d={d}")
    return _connected_draw("random_regular", lambda s: nx.random_regular_graph(d, n, seed=s), seed, max_tries)


# ---------------------------------------------------------------------------


def builder_params(name: str) -> dict[str, Any]:
    """The keyword parameters of builder ``name`` with their defaults."""
    sig = inspect.signature(BUILDERS.get(name))
    return {p.name: p.default for p in list(sig.parameters.values())[1:]}


def build(name: str, n: int, **params: Any) -> nx.Graph:
    """Build the named topology on nodes ``0..n-1``.

    Args:
        name: a builder name (see ``BUILDERS.names()``).
        n: number of nodes (agents), an integer >= 2.
        **params: the builder's own parameters (e.g. ``p``, ``seed``).

    Raises:
        ValueError: unknown name, bad n, unknown or bad parameter, or no
            connected graph could be drawn.

    Example::

        >>> G = build("torus", 12)
        >>> G.number_of_nodes(), G.number_of_edges()
        (12, 24)
    """
    fn = BUILDERS.get(name)
    n = _int("n", n, low=2)
    allowed = builder_params(name)
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        listed = ", ".join(allowed) if allowed else "none"
        raise ValueError(f"topology {name!r} takes no parameter {unknown[0]!r}; allowed: {listed}")
    G = fn(n, **params)
    G.graph["name"] = name
    return G
