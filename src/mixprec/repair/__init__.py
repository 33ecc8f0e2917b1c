"""The guards and their repairs, the high half of "is it still the same model?" (the
checks they grade with are :mod:`mixprec.checks`): the INT8 guard (:mod:`.int8_guard`)
and its repair, nodes back to float through the tuner (:mod:`.int8_repair`), both
running through :mod:`.int8_runs`; a language model's next-token guard
(:mod:`.language_guard`) and its repair, layers to 8 bits by sensitivity
(:mod:`.lm_repair`); the weight-only output check (:mod:`.weights_guard`)."""
