"""Decide, then apply: ``plan()`` makes every automatic decision of ``wrap()`` once, before anything
changes, and returns a frozen ``Plan`` (each decision with its reason, the priced memory plan);
``wrap(model, optimizer, plan=...)`` applies it and decides nothing again. What only the first
training steps can measure adapts the plan at run time, as logged events (``memory_report()``)."""

from ..memory.sizing import PlanRefused
from .decide import plan
from .plan import Decision, Plan

__all__ = ["Decision", "Plan", "PlanRefused", "plan"]
