"""Real English sentences for the MiniLM rows: one batch to measure, others to calibrate.

The INT8 rows calibrate on CALIBRATION_SENTENCES + MORE_CALIBRATION_SENTENCES, one sentence
per sample; none of them is in EVAL_SENTENCES.
"""

from __future__ import annotations

EVAL_SENTENCES: list[str] = [
    "The train to Edinburgh was delayed by forty minutes because of a signal failure.",
    "Mix the flour and butter until the dough feels like coarse breadcrumbs.",
    "She finally fixed the memory leak after profiling the service for two days.",
    "A cold front will bring heavy rain to the coast on Thursday night.",
    "How do I reset my password if I no longer have access to my email?",
    "The museum reopened with a new exhibition of early photographs.",
    "Quarterly revenue rose six percent, driven mostly by subscription sales.",
    "Dogs were barking in the distance.",
]

CALIBRATION_SENTENCES: list[str] = [
    "Please book a table for four people at seven o'clock tomorrow evening.",
    "The committee postponed its decision until more evidence is available.",
    "Water boils at a lower temperature at high altitude.",
    "Our flight was cancelled, so we took the night bus instead.",
    "The library lends laptops to students for up to two weeks.",
    "He planted tomatoes, basil and a row of sunflowers along the fence.",
    "Can you summarise the main findings of this report in three sentences?",
    "The bridge will be closed for repairs over the holiday weekend.",
]

MORE_CALIBRATION_SENTENCES: list[str] = [
    "The pharmacy on the corner closes at six on Sundays.",
    "I think the printer on the second floor is out of toner again.",
    "Researchers measured the glacier's retreat over three decades.",
    "Turn left after the petrol station and park behind the bakery.",
    "The new update drains the battery much faster than before.",
    "Children under twelve travel free when accompanied by an adult.",
    "She scored the winning goal in the final minute of extra time.",
    "Store the vaccine between two and eight degrees Celsius.",
]
