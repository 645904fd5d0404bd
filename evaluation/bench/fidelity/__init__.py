"""Fidelity benchmark: how far a compressed KV cache moves the model away from the full cache.

Two measurements, on RULER needle-in-a-haystack examples (chat-formatted as the kvpress pipeline
does it; the continuation is the question followed by the gold answer ``answer[0]``, teacher-forced):

1. End-to-end KL. For every continuation position t, KL(p_full(. | x_<t) || p_press(. | x_<t)),
   averaged over the continuation (``kl``; ``kl_answer`` averages only the positions that predict
   the gold answer tokens). One number per (example, configuration, seed); the seeds of a sampling
   method are averaged within an example, and the 95% interval is a Student-t interval over the
   example means (``evaluation.report.stats``, docs/protocol.md "Statistics"). A paired table compares,
   per scorer family, top-k / sampled + corrected / sampled uncorrected / Horvitz-Thompson on the
   same examples.
2. Layer-wise attention error: each layer's attention output (after ``o_proj``) at the
   continuation positions, relative to the full cache's, ||o - o_full||_F / ||o_full||_F. It is end
   to end: layer l's error includes what earlier layers passed on. Over the seeds of a sampling
   method the squared relative error splits into bias^2 = ||mean_s o_s - o_full||^2 / ||o_full||^2
   and variance = mean_s ||o_s - mean_s o_s||^2 / ||o_full||^2 (their sum is the mean squared
   error). ``--sweep`` adds the temperature T in {1, 2, 4, inf} at several ratios.

Every example is prefilled once and every configuration compressed and scored through
``evaluation.engine`` (``Prefill.compress``, ``teacher_forced``), the same replay the runner uses.

Modules: ``measure`` (configurations, the run loop, one JSON line per (example, configuration) in
``<out>/records.jsonl``, resumable), ``tables`` (the summaries of the records), ``report``
(``report.md``, ``summary.json``), ``plots``, ``cli`` (``python -m evaluation.bench fidelity``).
"""

DEFAULT_PRESSES = (
    "snapkv", "prob_snapkv", "prob_snapkv_nocorr", "prob_snapkv_ht",
    "tova", "prob_tova", "prob_tova_nocorr",
    "topk_min_h", "prob_min_h", "prob_min_h_nocorr", "prob_min_h_ht",
    "knorm", "prob_knorm",
)

# scorer families of the paired comparison: role -> registry name
FAMILIES = {
    "snapkv": {"top-k": "snapkv", "sampled": "prob_snapkv", "uncorrected": "prob_snapkv_nocorr", "HT": "prob_snapkv_ht"},
    "tova": {"top-k": "tova", "sampled": "prob_tova", "uncorrected": "prob_tova_nocorr"},
    "min_h": {"top-k": "topk_min_h", "sampled": "prob_min_h", "uncorrected": "prob_min_h_nocorr", "HT": "prob_min_h_ht"},
    "knorm": {"top-k": "knorm", "sampled": "prob_knorm", "uncorrected": "prob_knorm_nocorr"},
}
# (A, B): the table reports KL(A) - KL(B) per example; negative = A is closer to the full cache
PAIRS = (("sampled", "top-k"), ("uncorrected", "top-k"), ("HT", "top-k"), ("sampled", "uncorrected"), ("HT", "sampled"))
