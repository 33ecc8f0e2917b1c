"""The low half of "is it still the same model?": what every target, the tuner and
``optimize`` read without repairing anything. The held-out split (:mod:`.samples`), each
output kind's check and budget in one ``OutputCheck`` record (:mod:`.outputs`), the
confidence of a pass (:mod:`.confidence`), greedy continuations beside FP32's
(:mod:`.greedy`), the user's metric as it is called (:mod:`.user_metric`), and
``validate``'s comparison (:mod:`.validate`). The guards that repair sit higher, in
:mod:`mixprec.repair`."""
