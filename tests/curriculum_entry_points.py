"""A curriculum that moves on every few groups whatever they score, for `refbus up` tests that check the
difficulty rising end to end in a handful of steps. Node processes import it by name: the test puts tests/
on their ``PYTHONPATH``."""

from __future__ import annotations

from refbus.nodes.toy.task import Curriculum, CurriculumRule

GROUPS_PER_LEVEL = 16


class QuickCurriculum(Curriculum):
    rule = CurriculumRule(threshold=0.0, window=GROUPS_PER_LEVEL)
