"""From records to tables and figures: summaries, win scores, intervals, comparisons, the maximin rule, plots."""
