"""One run and many: the layer between the executors and the command line.

:mod:`.plan`
    the validation door: Config → Plan (graph, W, gap, algorithm), then Parts (data).
:mod:`.experiment`
    ONE run path for both executors (``run_experiment``).
:mod:`.checkpoint`, :mod:`.logger`, :mod:`.progress`
    checkpoints; TensorBoard event files; the progress bar, ETA and plain lines.
:mod:`.sweep`
    many runs from one sweep file → ``results.csv``.

Import from the modules (or the front, ``cdsgd.run_experiment``); this package
re-exports nothing, so importing one module does not load the others.
"""

__all__: list[str] = []
