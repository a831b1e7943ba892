"""The per-stage wake-ups (triggers.py): shared by the worker and the deletion handler, which kopf may start
before the stopped worker has left."""
from __future__ import annotations

from stage_operator.triggers import Triggers


def test_a_trigger_stays_while_anyone_holds_it():
    triggers = Triggers()
    worker, handler = triggers.register('ns', 's'), triggers.register('ns', 's')
    assert worker is handler
    triggers.unregister('ns', 's')  # the stopped worker leaves while the deletion handler waits
    triggers.fire('ns', 's')
    assert handler.is_set(), 'a pod event still wakes the deletion handler'
    handler.clear()
    triggers.unregister('ns', 's')
    triggers.fire('ns', 's')
    assert not handler.is_set(), 'nobody holds it: gone'
    assert triggers.register('ns', 's') is not handler
