"""Which attention-level measure predicts the decoded answer and the KL, with no decoding: ``run`` measures, ``report`` correlates."""
