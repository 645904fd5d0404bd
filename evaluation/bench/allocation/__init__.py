"""Allocation benchmark (CLI name ``budget``, outputs in ``<out>/budget/``): where the budget of the
probabilistic presses goes, how close the realised compression ratio is to the target, and what
padding each layer to its largest head costs.

For every proposal and RULER example the prefill runs once through ``evaluation.engine``
(``Prefill``, ``proposals_of``, ``compress`` at r = ``ratio``, global budget, seed = example index):
the press's ``stats`` are recorded, and the per-layer proposals pi it drew from are kept. The draws
for the other ratios, scopes and seeds are then made by the press's own ``sampler`` on those pi,
so the expensive prefill runs once per (proposal, example); the redraw at the press's own settings
is checked to give the press's kept set exactly (``redraw_matches_press`` in the JSON).

Figures (per draw): kept fraction per layer and KV head = kept / n; realised ratio
1 - sum kept / (L H n); the stored (padded) length of a layer = its largest head's kept count;
padding factor of a layer = H * stored / sum_h kept (1 = no padding); overall padding = stored
entries / kept entries over the model (the press's ``stats['padding']``).

Modules: ``measure`` (the runs), ``report`` (tables, plots, outputs), ``cli``.
"""
