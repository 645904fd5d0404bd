"""Scores: answer matching (``answers``), teacher-forced continuation KL and NLL (``continuation``), needle survival (``survival``)."""
