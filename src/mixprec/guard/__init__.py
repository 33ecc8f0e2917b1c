"""One home for "is it still the same model?": the held-out split (:mod:`.samples`), the
checks and budgets of each output kind (:mod:`.checks`), the confidence of a pass
(:mod:`.confidence`), the guards with their repairs: INT8 nodes back to float
(:mod:`.int8`), a language model's layers to 8 bits (:mod:`.language`), the weight-only
output check (:mod:`.weights`), and ``validate``'s comparison (:mod:`.validate`)."""
