"""What a run leaves for people and other tools: figures and exported models.

:mod:`.plotting`
    a run's curves, a sweep's figures (``plot_run``, ``plot_sweep``).
:mod:`.time_to_target`
    a sweep's time_to_target.png (drawn for ``plot_sweep``).
:mod:`.axes`
    how their axes read: whole epochs, log scales only across a decade, bytes and seconds in words.
:mod:`.topology_drawing`
    a graph's picture (``draw_topology``).
:mod:`.export`
    a run's ``params.pt`` → a standard ``state_dict`` of its model.

Import from the modules; this package re-exports nothing (matplotlib loads
only when a figure is drawn).
"""

__all__: list[str] = []
